package policyserver

// Operator operations in etcd (docs/etcd.md, "Operations"): replicas over
// one etcd cluster share them, so that the operator's request, the agent's
// claim, its report and the operator's wait may each reach another replica,
// and a replica killed in between loses nothing. Keys:
//
//	PREFIX ops/ID   the operation's JSON, under a shared lease of about
//	                keepFinished (a queued or running one is finished,
//	                and so rewritten, long before it lapses)
//
// Every change of an operation (claim, report, expiry) is a transaction
// conditioned on the ModRevision the change read: of two replicas serving
// claims for the same agent, or of a report racing the expiry, exactly one
// wins, and the other reads again. Creation is conditioned on the agent's
// registration (PREFIX agents/HOST, under its lease) existing, so that an
// operation for an agent whose registration lapsed is refused at once.
// Each replica watches PREFIX ops/ to wake its waiting claims and waits.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dysco/dysco/internal/api"
)

// etcdOps keeps the operations in etcd.
type etcdOps struct {
	cli    *clientv3.Client
	st     *etcdStore
	ttl    time.Duration // of the agents' registrations
	prefix string        // PREFIX ops/
	agents string        // PREFIX agents/
	log    *slog.Logger

	mu      sync.Mutex
	changed chan struct{} // closed and replaced on every change seen
	lease   clientv3.LeaseID
	leaseAt time.Time

	cancel context.CancelFunc
	done   chan struct{}
}

var _ opStore = (*etcdOps)(nil)

// maxEtcdOp bounds an operation's JSON in etcd, whose requests are at most
// 1.5 MiB by default (--max-request-bytes); a larger result is refused
// (413), and the agent reports that instead. A variable for tests.
var maxEtcdOp = 1 << 20

// opLeaseReuse is how long one lease serves the operations written: each
// is kept between keepFinished and keepFinished plus this.
const opLeaseReuse = time.Minute

// newEtcdOps keeps operations in st's etcd, under st's prefix.
func newEtcdOps(st *etcdStore, ttl time.Duration) *etcdOps {
	o := &etcdOps{cli: st.cli, st: st, ttl: ttl, prefix: st.prefix + "ops/", agents: st.prefix + "agents/", log: st.log,
		changed: make(chan struct{}), done: make(chan struct{})}
	wctx, wcancel := context.WithCancel(context.Background())
	o.cancel = wcancel
	go o.watch(wctx)
	return o
}

func (o *etcdOps) close() {
	o.cancel()
	<-o.done
}

// current is the channel the next change closes.
func (o *etcdOps) current() <-chan struct{} {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.changed
}

func (o *etcdOps) bump() {
	o.mu.Lock()
	close(o.changed)
	o.changed = make(chan struct{})
	o.mu.Unlock()
}

// watch wakes the waiters on every change of an operation, from the
// store's revision when it starts (read again until etcd answers: a
// replica may start without a quorum). A watch that ends (no leader, the
// member gone) wakes them too, so that they read again (and fail fast
// without a quorum); after a compaction it goes on from the oldest
// revision kept (the waiters read again whatever they missed).
func (o *etcdOps) watch(ctx context.Context) {
	defer close(o.done)
	var rev int64
	for backoff := 100 * time.Millisecond; ; {
		gctx, cancel := o.ctx(ctx)
		resp, err := o.cli.Get(gctx, o.prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
		cancel()
		if err == nil {
			rev = resp.Header.Revision
			break
		}
		if !backOff(ctx, &backoff) {
			return
		}
	}
	// Whatever changed before the revision read is read by the waiters.
	o.bump()
	follow(ctx, o.cli, o.prefix, true, rev, o.bump,
		func(compacted, _ int64) int64 { o.bump(); return compacted - 1 },
		func(error) { o.bump() })
}

// ctx bounds a request and requires a leader.
func (o *etcdOps) ctx(parent context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(parent, storeTimeout)
	return clientv3.WithRequireLeader(ctx), cancel
}

// storedOp is an operation as read, with its key's revisions.
type storedOp struct {
	op          api.Operation
	key         string
	mod, create int64
}

// decodeOp reads one key's operation.
func decodeOp(kv []byte) (api.Operation, error) {
	var op api.Operation
	err := json.Unmarshal(kv, &op)
	return op, err
}

// readAll reads every operation, in creation order. A value that is not an
// operation is skipped, and logged.
func (o *etcdOps) readAll(ctx context.Context) ([]storedOp, error) {
	resp, err := o.cli.Get(ctx, o.prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, quorumErr(err)
	}
	out := make([]storedOp, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		op, err := decodeOp(kv.Value)
		if err != nil {
			o.log.Warn("etcd: not an operation; skipped", "key", string(kv.Key), "err", err)
			continue
		}
		out = append(out, storedOp{op: op, key: string(kv.Key), mod: kv.ModRevision, create: kv.CreateRevision})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].create < out[j].create })
	return out, nil
}

// leaseID is the lease new writes go under: granted for keepFinished plus
// opLeaseReuse, and used for opLeaseReuse.
func (o *etcdOps) leaseID(ctx context.Context) (clientv3.LeaseID, error) {
	o.mu.Lock()
	id, at := o.lease, o.leaseAt
	o.mu.Unlock()
	if id != 0 && time.Since(at) < opLeaseReuse {
		return id, nil
	}
	l, err := o.cli.Grant(ctx, int64((keepFinished+opLeaseReuse)/time.Second))
	if err != nil {
		return 0, quorumErr(err)
	}
	o.mu.Lock()
	o.lease, o.leaseAt = l.ID, time.Now()
	o.mu.Unlock()
	return l.ID, nil
}

// putIf writes op over s unless s's key changed since it was read; extra
// conditions and operations go in the same transaction.
func (o *etcdOps) putIf(ctx context.Context, s storedOp, op api.Operation) (bool, error) {
	data, err := json.Marshal(op)
	if err != nil {
		return false, err
	}
	lease, err := o.leaseID(ctx)
	if err != nil {
		return false, err
	}
	tx, err := o.cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(s.key), "=", s.mod)).
		Then(clientv3.OpPut(s.key, string(data), clientv3.WithLease(lease))).Commit()
	if err != nil {
		return false, quorumErr(err)
	}
	return tx.Succeeded, nil
}

// expire fails the operations of ops past their deadline at now, in etcd
// and in ops. It tells whether another replica changed one of them first
// (ops is then stale: read again).
func (o *etcdOps) expire(ctx context.Context, ops []storedOp, now time.Time) (bool, error) {
	stale := false
	for i := range ops {
		op := ops[i].op
		if !expired(&op, now) {
			continue
		}
		ok, err := o.putIf(ctx, ops[i], op)
		if err != nil {
			return false, err
		}
		if !ok {
			stale = true
			continue
		}
		ops[i].op = op
	}
	return stale, nil
}

// readFresh reads every operation and expires those past their deadline.
func (o *etcdOps) readFresh(ctx context.Context) ([]storedOp, error) {
	for range etcdRetries {
		ops, err := o.readAll(ctx)
		if err != nil {
			return nil, err
		}
		stale, err := o.expire(ctx, ops, time.Now())
		if err != nil || !stale {
			return ops, err
		}
	}
	return nil, fmt.Errorf("etcd: the operations changed %d times while they were read; try again", etcdRetries)
}

// newOpID is an operation ID unique across replicas and runs.
func newOpID(now time.Time) string {
	var b [5]byte
	rand.Read(b[:])
	return "op-" + strconv.FormatInt(now.UnixMilli(), 36) + "-" + hex.EncodeToString(b[:])
}

// create implements opStore.
func (o *etcdOps) create(parent context.Context, op api.Operation) (api.Operation, int, error) {
	if err := o.st.quorumNow(); err != nil {
		return op, 0, err
	}
	ctx, cancel := o.ctx(parent)
	defer cancel()
	ops, err := o.readFresh(ctx)
	if err != nil {
		return op, 0, err
	}
	agentKey := o.agents + op.Host
	reg, err := o.cli.Get(ctx, agentKey, clientv3.WithCountOnly())
	if err != nil {
		return op, 0, quorumErr(err)
	}
	notRegistered := fmt.Errorf("no agent named %q is registered with the policy servers (an agent registers with each policy poll when started with --policy-server, and its registration lapses %s after the last word from it; the name is the agent's --name; `dysco status --cluster` lists them)", op.Host, o.ttl)
	if reg.Count == 0 {
		return op, http.StatusConflict, notRegistered
	}
	var finished []storedOp
	active := 0
	for _, s := range ops {
		if s.op.IsFinished() {
			finished = append(finished, s)
		} else {
			active++
		}
	}
	if active >= maxActiveOps {
		return op, http.StatusServiceUnavailable, fmt.Errorf("%d operations are queued or running; try again when some have finished", active)
	}
	now := time.Now()
	op.ID = newOpID(now)
	op.State, op.Created = api.OpQueued, now
	data, err := json.Marshal(op)
	if err != nil {
		return op, 0, err
	}
	lease, err := o.leaseID(ctx)
	if err != nil {
		return op, 0, err
	}
	then := []clientv3.Op{clientv3.OpPut(o.prefix+op.ID, string(data), clientv3.WithLease(lease))}
	// The oldest finished ones go beyond maxKeptOps.
	sort.Slice(finished, func(i, j int) bool { return finished[i].op.Finished.Before(finished[j].op.Finished) })
	for i := 0; len(finished)-i >= maxKeptOps; i++ {
		then = append(then, clientv3.OpDelete(finished[i].key))
	}
	tx, err := o.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(agentKey), ">", 0)).Then(then...).Commit()
	if err != nil {
		return op, 0, quorumErr(err)
	}
	if !tx.Succeeded {
		return op, http.StatusConflict, notRegistered
	}
	return op, 0, nil
}

// list implements opStore.
func (o *etcdOps) list(parent context.Context) ([]api.Operation, error) {
	ctx, cancel := o.ctx(parent)
	defer cancel()
	ops, err := o.readFresh(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]api.Operation, 0, len(ops))
	for _, s := range ops {
		out = append(out, s.op)
	}
	return out, nil
}

// readOne reads operation id (ok false: none).
func (o *etcdOps) readOne(ctx context.Context, id string) (storedOp, bool, error) {
	key := o.prefix + id
	resp, err := o.cli.Get(ctx, key)
	if err != nil {
		return storedOp{}, false, quorumErr(err)
	}
	if len(resp.Kvs) == 0 {
		return storedOp{}, false, nil
	}
	kv := resp.Kvs[0]
	op, err := decodeOp(kv.Value)
	if err != nil {
		return storedOp{}, false, fmt.Errorf("etcd: %s is not an operation: %w", key, err)
	}
	return storedOp{op: op, key: key, mod: kv.ModRevision, create: kv.CreateRevision}, true, nil
}

// validID tells whether id can name an operation's key (no path below ops/).
func validID(id string) bool {
	return id != "" && len(id) <= 64 && !strings.ContainsAny(id, "/\x00")
}

// get implements opStore.
func (o *etcdOps) get(parent context.Context, id string) (api.Operation, bool, <-chan struct{}, error) {
	changed := o.current() // before the read: a change after it wakes the caller
	if !validID(id) {
		return api.Operation{}, false, changed, nil
	}
	ctx, cancel := o.ctx(parent)
	defer cancel()
	for range etcdRetries {
		s, ok, err := o.readOne(ctx, id)
		if err != nil || !ok {
			return api.Operation{}, false, changed, err
		}
		op := s.op
		if !expired(&op, time.Now()) {
			return op, true, changed, nil
		}
		if ok, err := o.putIf(ctx, s, op); err != nil || ok {
			return op, true, changed, err
		}
	}
	return api.Operation{}, false, changed, fmt.Errorf("etcd: operation %s changed %d times while it was read; try again", id, etcdRetries)
}

// claimNext implements opStore.
func (o *etcdOps) claimNext(parent context.Context, host string) (api.Operation, bool, <-chan struct{}, error) {
	changed := o.current()
	if err := o.st.quorumNow(); err != nil {
		return api.Operation{}, false, changed, err
	}
	ctx, cancel := o.ctx(parent)
	defer cancel()
	for range etcdRetries {
		ops, err := o.readFresh(ctx)
		if err != nil {
			return api.Operation{}, false, changed, err
		}
		var next *storedOp
		for i := range ops {
			if ops[i].op.Host == host && ops[i].op.State == api.OpQueued {
				next = &ops[i]
				break
			}
		}
		if next == nil || parent.Err() != nil {
			return api.Operation{}, false, changed, nil
		}
		op := next.op
		op.State, op.Claimed = api.OpRunning, time.Now()
		ok, err := o.putIf(ctx, *next, op)
		if err != nil {
			return api.Operation{}, false, changed, err
		}
		if ok {
			return op, true, nil, nil
		}
		// Another replica claimed or expired it first: look again.
	}
	return api.Operation{}, false, changed, fmt.Errorf("etcd: the operations changed %d times while one was claimed; try again", etcdRetries)
}

// report implements opStore.
func (o *etcdOps) report(parent context.Context, id string, res api.OperationResult, caller string) (int, error) {
	if !validID(id) {
		return http.StatusNotFound, fmt.Errorf("no operation %q here", id)
	}
	ctx, cancel := o.ctx(parent)
	defer cancel()
	for range etcdRetries {
		s, ok, err := o.readOne(ctx, id)
		if err != nil {
			return 0, err
		}
		if !ok {
			return http.StatusNotFound, fmt.Errorf("no operation %q here", id)
		}
		op := s.op
		now := time.Now()
		expired(&op, now)
		code, ferr := finishWith(&op, id, res, caller, now)
		if ferr != nil && op.State == s.op.State {
			return code, ferr // refused, nothing to write
		}
		if ferr == nil {
			if data, err := json.Marshal(op); err == nil && len(data) > maxEtcdOp {
				return http.StatusRequestEntityTooLarge, fmt.Errorf("operation %s: the result takes %d bytes, more than the %d an operation may take in etcd (etcd's requests are at most 1.5 MiB)", id, len(data), maxEtcdOp)
			}
		}
		// Taken, or refused because it just expired: write either.
		ok, err = o.putIf(ctx, s, op)
		if err != nil {
			return 0, err
		}
		if ok {
			return code, ferr
		}
	}
	return 0, fmt.Errorf("etcd: operation %s changed %d times while it was reported; try again", id, etcdRetries)
}

// polling implements opStore: an agent's liveness is its registration.
func (o *etcdOps) polling(string, bool) {}
