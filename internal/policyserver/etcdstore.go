package policyserver

// The policy set in etcd (docs/etcd.md): policy servers are then stateless
// replicas over one etcd cluster. Keys under a prefix (default /dysco/v1/):
//
//	PREFIX policies/NAME   the policy's JSON
//	PREFIX types/NAME      the middlebox type's JSON
//	PREFIX meta/version    written by every change: its ModRevision, the
//	                       store's revision at the last change, is the set's
//	                       version
//	PREFIX agents/HOST     an agent's registration, under its lease
//
// Every change is one transaction conditioned on meta/version being the one
// the change read: changes from several replicas are serialized by etcd,
// and the bounds (FullError) and a type's use (TypeInUseError) are checked
// against the set the change applies to. Each replica watches meta/version
// from the revision of the set it holds, requiring a leader (a member cut
// off from the quorum ends the watch instead of going quiet), and reloads
// the set when it changes or when the watch fell behind a compaction.

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"

	"github.com/dysco/dysco/internal/api"
)

// DefaultEtcdPrefix is where the policy set lives in etcd.
const DefaultEtcdPrefix = "/dysco/v1/"

// storeTimeout bounds every request to etcd or the Kubernetes API server:
// without a quorum a write fails within it, with a NoQuorumError.
const storeTimeout = 3 * time.Second

// etcdRetries bounds the retries of a change that raced another replica's.
const etcdRetries = 16

// NoQuorumError says that etcd could not commit or serve a request: no
// leader, or not enough members reachable.
type NoQuorumError struct {
	Err error
	// Kube is set when the store is the Kubernetes API, not etcd.
	Kube bool
}

func (e *NoQuorumError) Error() string {
	if e.Kube {
		return fmt.Sprintf("the Kubernetes API server cannot be reached or cannot serve: %v; the agents keep the policies they have", e.Err)
	}
	return fmt.Sprintf("etcd has no quorum (no leader, or too few members reachable): %v; the agents keep the policies they have", e.Err)
}

func (e *NoQuorumError) Unwrap() error { return e.Err }

// quorumErr turns the errors of a request that etcd could not serve for
// want of a quorum into a *NoQuorumError.
func quorumErr(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, rpctypes.ErrNoLeader) ||
		errors.Is(err, rpctypes.ErrGRPCNoLeader) || strings.Contains(err.Error(), "no leader") {
		return &NoQuorumError{Err: err}
	}
	return err
}

// etcdStore keeps the policy set in etcd.
type etcdStore struct {
	cli    *clientv3.Client
	prefix string
	log    *slog.Logger
	// onChange runs when the watch sees the set change (this replica's
	// changes or another's).
	onChange func()
	cancel   context.CancelFunc
	done     chan struct{} // closed when watch has stopped
	probed   chan struct{} // closed when probe has stopped (nil: never started)

	// storeHealth is what the last probe of etcd found; rev is the
	// revision of the set last loaded or seen changed.
	storeHealth
	rev atomic.Int64

	// leases are the leases of the agents this replica registered, by
	// host: a registration lives under its agent's lease, which each poll
	// keeps alive.
	leaseMu sync.Mutex
	leases  map[string]agentLease
	swept   time.Time // the last look for lapsed leases
	// hostMu serializes the registrations of one host (by a hash of its
	// name): two at once would each grant a lease, and the key could end
	// under the one this replica does not keep alive.
	hostMu [64]sync.Mutex
}

var _ Store = (*etcdStore)(nil)

func (s *etcdStore) key(kind, name string) string { return s.prefix + kind + "/" + name }
func (s *etcdStore) metaKey() string              { return s.prefix + "meta/version" }

// openEtcdStore connects to etcd and starts watching the set; onChange runs
// on every change seen, and onLoad (nil: nobody) gets the set once read,
// before the store says it is healthy. A store that cannot read the set
// at once because etcd is unreachable or has no quorum (it is starting
// too, or an outage) opens all the same, unhealthy: it reads the set as
// soon as it can, and only then becomes healthy and watches. A configuration etcd refuses (TLS, a URL that is not one) is
// an error.
func openEtcdStore(cfg clientv3.Config, prefix string, log *slog.Logger, onChange func(), onLoad func(api.PolicySet)) (*etcdStore, error) {
	if prefix == "" {
		prefix = DefaultEtcdPrefix
	}
	if !strings.HasSuffix(prefix, "/") {
		prefix += "/"
	}
	if cfg.DialTimeout == 0 {
		cfg.DialTimeout = storeTimeout
	}
	cli, err := clientv3.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("etcd %s: %w", strings.Join(cfg.Endpoints, ","), err)
	}
	s := &etcdStore{cli: cli, prefix: prefix, log: log, onChange: onChange, done: make(chan struct{})}
	s.lost = "this policy server's etcd members are cut off from the quorum or unreachable"
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	set, rev, err := s.load(ctx)
	if err != nil {
		// A refused certificate looks like a member that never answers
		// to the client (gRPC retries the handshake): say which it is.
		if fatal, derr := diagnoseEtcd(cfg); fatal {
			cancel()
			cli.Close()
			return nil, derr
		}
		log.Warn("etcd: no quorum at start; this replica answers 503 until it has read the policy set", "endpoints", strings.Join(cfg.Endpoints, ","), "err", err)
		go s.loadLater(ctx, onLoad)
		return s, nil
	}
	if onLoad != nil {
		onLoad(set)
	}
	s.loaded.Store(true)
	s.ok.Store(true)
	go s.watch(ctx, rev)
	return s, nil
}

// loadLater reads the set until it can (back-off with jitter, 100 ms
// doubling to 5 s), hands it to onLoad, and watches from there.
func (s *etcdStore) loadLater(ctx context.Context, onLoad func(api.PolicySet)) {
	for backoff := 100 * time.Millisecond; ; {
		if !backOff(ctx, &backoff) {
			close(s.done)
			return
		}
		set, rev, err := s.load(ctx)
		if err != nil {
			continue
		}
		if onLoad != nil {
			onLoad(set)
		}
		s.loaded.Store(true)
		s.log.Info("etcd: policy set read", "version", set.Version, "policies", len(set.Policies), "types", len(set.Types))
		s.watch(ctx, rev)
		return
	}
}

// startProbe starts checking the quorum; onHealth runs on every change.
func (s *etcdStore) startProbe(onHealth func()) {
	s.onHealth = onHealth
	s.probed = make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	stop := s.cancel
	s.cancel = func() { stop(); cancel() }
	go s.probe(ctx)
}

// probeEvery is how often a replica checks that etcd has a quorum for it.
var probeEvery = time.Second

// probe reads meta/version linearizably (a leader required) every
// probeEvery: a replica whose member is cut off from the quorum, or
// unreachable, is unhealthy within probeEvery plus storeTimeout (a watch
// alone can go quiet on a lost connection without an error). A version
// newer than the one last seen runs onChange too, should the watch have
// missed it.
func (s *etcdStore) probe(ctx context.Context) {
	defer close(s.probed)
	t := time.NewTicker(probeEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		pctx, cancel := s.ctx(ctx)
		resp, err := s.cli.Get(pctx, s.metaKey())
		cancel()
		if ctx.Err() != nil {
			return
		}
		was := s.set(err == nil && s.loaded.Load())
		if err != nil {
			if was {
				s.log.Warn("etcd: no quorum; agents polling this replica are told to ask another", "err", err)
			}
			continue
		}
		if !was {
			s.log.Info("etcd: quorum back")
		}
		if len(resp.Kvs) > 0 && resp.Kvs[0].ModRevision > s.rev.Load() {
			s.onChange()
		}
	}
}

// diagnoseEtcd connects to each endpoint of cfg as the client would, and
// returns why none serves it: not reachable, or TLS refused (a missing or
// foreign client certificate, a server certificate of another CA); nil
// when one takes the connection. fatal says that the configuration is at
// fault (TLS refused, not a URL), not etcd's being down.
func diagnoseEtcd(cfg clientv3.Config) (fatal bool, err error) {
	var errs []error
	for _, ep := range cfg.Endpoints {
		u, err := url.Parse(ep)
		if err != nil || u.Host == "" {
			errs = append(errs, fmt.Errorf("etcd %s: not a URL (want http:// or https://HOST:PORT)", ep))
			fatal = true
			continue
		}
		conn, err := net.DialTimeout("tcp", u.Host, 2*time.Second)
		if err != nil {
			errs = append(errs, fmt.Errorf("etcd %s: unreachable: %w", ep, err))
			continue
		}
		if u.Scheme != "https" || cfg.TLS == nil {
			conn.Close()
			return false, nil
		}
		tc := cfg.TLS.Clone()
		if tc.ServerName == "" {
			tc.ServerName = u.Hostname()
		}
		tc.NextProtos = []string{"h2"}
		c := tls.Client(conn, tc)
		c.SetDeadline(time.Now().Add(2 * time.Second))
		err = c.Handshake()
		if err == nil {
			// With TLS 1.3 a refused client certificate arrives as an
			// alert after the handshake: wait for it a moment.
			c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
			_, err = c.Read(make([]byte, 1))
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				err = nil
			}
		}
		c.Close()
		if err == nil {
			return false, nil
		}
		fatal = true
		errs = append(errs, fmt.Errorf("etcd %s: TLS refused: %w (check --etcd-cert, --etcd-key and --etcd-ca: etcd wants a client certificate of its CA, and its own certificate must be signed by --etcd-ca)", ep, err))
	}
	return fatal, errors.Join(errs...)
}

// etcdClientConfig is the etcd client configuration of cfg: its endpoints,
// and mutual TLS when it names a certificate or a CA.
func etcdClientConfig(cfg Config) (clientv3.Config, error) {
	ec := clientv3.Config{Endpoints: cfg.Etcd, DialTimeout: storeTimeout, Logger: zap.NewNop(),
		// Reconnect to a member that was down within seconds of its
		// return (gRPC's own back-off grows to two minutes).
		DialOptions: []grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 2 * time.Second},
			MinConnectTimeout: 2 * time.Second,
		})},
		// A member lost without a word (a link down) is dropped from the
		// balancer within about 7 s; 5 s is etcd's smallest keepalive
		// interval by default (--grpc-keepalive-min-time).
		DialKeepAliveTime: 5 * time.Second, DialKeepAliveTimeout: 2 * time.Second}
	if cfg.EtcdCertFile == "" && cfg.EtcdKeyFile == "" && cfg.EtcdCAFile == "" {
		return ec, nil
	}
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if cfg.EtcdCertFile != "" || cfg.EtcdKeyFile != "" {
		c, err := tls.LoadX509KeyPair(cfg.EtcdCertFile, cfg.EtcdKeyFile)
		if err != nil {
			return ec, fmt.Errorf("etcd client certificate: %w", err)
		}
		tc.Certificates = []tls.Certificate{c}
	}
	if cfg.EtcdCAFile != "" {
		pem, err := os.ReadFile(cfg.EtcdCAFile)
		if err != nil {
			return ec, fmt.Errorf("etcd CA: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return ec, fmt.Errorf("etcd CA %s: no certificate in it", cfg.EtcdCAFile)
		}
		tc.RootCAs = pool
	}
	ec.TLS = tc
	return ec, nil
}

// ctx bounds a request and requires a leader.
func (s *etcdStore) ctx(parent context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(parent, storeTimeout)
	return clientv3.WithRequireLeader(ctx), cancel
}

// load reads the set and the store's revision it was read at.
func (s *etcdStore) load(parent context.Context) (api.PolicySet, int64, error) {
	ctx, cancel := s.ctx(parent)
	defer cancel()
	resp, err := s.getSet(ctx)
	if err != nil {
		return api.PolicySet{}, 0, quorumErr(err)
	}
	set, err := s.decode(resp)
	if err == nil {
		s.seen(int64(set.Version))
	}
	return set, resp.Header.Revision, err
}

// seen records that the set of version v was loaded.
func (s *etcdStore) seen(v int64) {
	for {
		cur := s.rev.Load()
		if v <= cur || s.rev.CompareAndSwap(cur, v) {
			return
		}
	}
}

// getSet reads the keys of the set: meta/, policies/ and types/, in key
// order (not the agents' registrations, agents/, before them).
func (s *etcdStore) getSet(ctx context.Context) (*clientv3.GetResponse, error) {
	return s.cli.Get(ctx, s.prefix+"meta/", clientv3.WithRange(s.prefix+"types0"))
}

// decode builds the set from getSet's answer.
func (s *etcdStore) decode(resp *clientv3.GetResponse) (api.PolicySet, error) {
	set := api.PolicySet{Policies: []api.Policy{}, Types: []api.MiddleboxType{}}
	for _, kv := range resp.Kvs {
		k := strings.TrimPrefix(string(kv.Key), s.prefix)
		switch {
		case k == "meta/version":
			set.Version = uint64(kv.ModRevision)
		case strings.HasPrefix(k, "policies/"):
			var p api.Policy
			if err := json.Unmarshal(kv.Value, &p); err != nil {
				return api.PolicySet{}, fmt.Errorf("policy %q: %w", strings.TrimPrefix(k, "policies/"), err)
			}
			set.Policies = append(set.Policies, p)
		case strings.HasPrefix(k, "types/"):
			var t api.MiddleboxType
			if err := json.Unmarshal(kv.Value, &t); err != nil {
				return api.PolicySet{}, fmt.Errorf("type %q: %w", strings.TrimPrefix(k, "types/"), err)
			}
			set.Types = append(set.Types, t)
		}
	}
	sortSet(&set)
	return set, nil
}

// Load implements Store.
func (s *etcdStore) Load(ctx context.Context) (api.PolicySet, error) {
	set, _, err := s.load(ctx)
	return set, err
}

// change runs fn on the set as it is and commits what it returns (puts,
// deletes) with a new version, unless another change came in between: then
// it runs again on the newer set. fn returns no operations for no change.
func (s *etcdStore) change(parent context.Context, fn func(set api.PolicySet, kvs map[string][]byte) ([]clientv3.Op, error)) (bool, error) {
	// Each try has half of storeTimeout: a request that went to a member
	// lost without a word (its connection not yet known dead) times out,
	// and the next goes to another member, within storeTimeout in all.
	if err := s.quorumNow(); err != nil {
		return false, err
	}
	budget := time.Now().Add(storeTimeout)
	retry := func(err error) bool {
		var nq *NoQuorumError
		return errors.As(err, &nq) && time.Until(budget) >= storeTimeout/2 && parent.Err() == nil
	}
	for range etcdRetries {
		ctx, cancel := context.WithTimeout(parent, storeTimeout/2)
		ctx = clientv3.WithRequireLeader(ctx)
		resp, err := s.getSet(ctx)
		if err != nil {
			cancel()
			if err = quorumErr(err); retry(err) {
				continue
			}
			return false, err
		}
		set, err := s.decode(resp)
		if err != nil {
			cancel()
			return false, err
		}
		kvs := map[string][]byte{}
		var metaRev int64
		for _, kv := range resp.Kvs {
			kvs[string(kv.Key)] = kv.Value
			if string(kv.Key) == s.metaKey() {
				metaRev = kv.ModRevision
			}
		}
		ops, err := fn(set, kvs)
		if err != nil || len(ops) == 0 {
			cancel()
			return false, err
		}
		ops = append(ops, clientv3.OpPut(s.metaKey(), ""))
		tx, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(s.metaKey()), "=", metaRev)).Then(ops...).Commit()
		cancel()
		if err != nil {
			// The transaction may have committed: the next try reads
			// the set again, and finds the change made or not.
			if err = quorumErr(err); retry(err) {
				continue
			}
			return false, err
		}
		if tx.Succeeded {
			return true, nil
		}
	}
	return false, fmt.Errorf("etcd: the policy set changed %d times while this change was tried; try again", etcdRetries)
}

// put stores v under kind/name unless it is stored so already; limit bounds
// the number of objects of the kind.
func (s *etcdStore) put(ctx context.Context, kind, name string, v any, limit int, what string) (bool, error) {
	data, err := json.Marshal(v)
	if err != nil {
		return false, err
	}
	key := s.key(kind, name)
	return s.change(ctx, func(set api.PolicySet, kvs map[string][]byte) ([]clientv3.Op, error) {
		old, ok := kvs[key]
		if ok && string(old) == string(data) {
			return nil, nil
		}
		if !ok {
			n := 0
			for k := range kvs {
				if strings.HasPrefix(k, s.prefix+kind+"/") {
					n++
				}
			}
			if n >= limit {
				return nil, &FullError{Kind: what, Limit: limit}
			}
		}
		return []clientv3.Op{clientv3.OpPut(key, string(data))}, nil
	})
}

// PutPolicy implements Store.
func (s *etcdStore) PutPolicy(ctx context.Context, p api.Policy) (bool, error) {
	return s.put(ctx, "policies", p.Name, p, api.MaxStoredPolicies, "policies")
}

// PutType implements Store.
func (s *etcdStore) PutType(ctx context.Context, t api.MiddleboxType) (bool, error) {
	return s.put(ctx, "types", t.Name, t, api.MaxTypes, "middlebox types")
}

// DeletePolicy implements Store.
func (s *etcdStore) DeletePolicy(ctx context.Context, name string) (bool, error) {
	key := s.key("policies", name)
	return s.change(ctx, func(_ api.PolicySet, kvs map[string][]byte) ([]clientv3.Op, error) {
		if _, ok := kvs[key]; !ok {
			return nil, nil
		}
		return []clientv3.Op{clientv3.OpDelete(key)}, nil
	})
}

// DeleteType implements Store: refused while a policy of the same set
// names the type.
func (s *etcdStore) DeleteType(ctx context.Context, name string) (bool, error) {
	key := s.key("types", name)
	found := false
	_, err := s.change(ctx, func(set api.PolicySet, kvs map[string][]byte) ([]clientv3.Op, error) {
		if _, ok := kvs[key]; !ok {
			found = false
			return nil, nil
		}
		found = true
		if users := api.PoliciesUsingType(set.Policies, name); len(users) > 0 {
			return nil, &api.TypeInUseError{Type: name, Policies: users}
		}
		return []clientv3.Op{clientv3.OpDelete(key)}, nil
	})
	return found, err
}

// watch follows meta/version from revision rev on, and runs onChange for
// every change of the set; after a compaction past rev it reads the whole
// set again and goes on from there.
func (s *etcdStore) watch(ctx context.Context, rev int64) {
	defer close(s.done)
	// Every change of the set writes meta/version: its events are the
	// set's changes, and registrations wake nobody.
	follow(ctx, s.cli, s.metaKey(), false, rev, s.onChange,
		func(compacted, had int64) int64 {
			s.log.Warn("etcd: the watch fell behind a compaction; reloading the policy set", "compacted", compacted, "had", had)
			if _, r, err := s.load(ctx); err == nil {
				s.onChange()
				return r
			}
			return had
		},
		func(err error) { s.log.Warn("etcd: watch ended", "err", err) })
}

// follow watches key (every key under it when prefix) from revision rev
// on, with a leader required (a member cut off from the quorum ends the
// watch instead of going quiet), until ctx ends. events runs for each
// response with events; compacted, when the watch fell behind a
// compaction, returns the revision to go on from; ended runs when a watch
// ends otherwise. A watch that ended starts again after a back-off with
// jitter, from 100 ms doubling to 5 s, back to 100 ms after events.
func follow(ctx context.Context, cli *clientv3.Client, key string, prefix bool, rev int64,
	events func(), compacted func(compacted, had int64) int64, ended func(error)) {
	backoff := 100 * time.Millisecond
	opts := []clientv3.OpOption{clientv3.WithRev(0)}
	if prefix {
		opts = append(opts, clientv3.WithPrefix())
	}
	for ctx.Err() == nil {
		opts[0] = clientv3.WithRev(rev + 1)
		for resp := range cli.Watch(clientv3.WithRequireLeader(ctx), key, opts...) {
			if resp.CompactRevision > 0 {
				rev = compacted(resp.CompactRevision, rev)
				break
			}
			if err := resp.Err(); err != nil {
				ended(err)
				break
			}
			if len(resp.Events) > 0 {
				rev = resp.Header.Revision
				backoff = 100 * time.Millisecond
				events()
			}
		}
		if !backOff(ctx, &backoff) {
			return
		}
	}
}

// backOff waits between *d and twice *d (jitter), then doubles
// *d up to 5 s; it returns false, at once, when ctx ends. The replicas'
// watches and reads that wait for etcd back off with it, from 100 ms.
func backOff(ctx context.Context, d *time.Duration) bool {
	wait := *d + time.Duration(rand.Int64N(int64(*d)))
	*d = min(2**d, 5*time.Second)
	select {
	case <-ctx.Done():
		return false
	case <-time.After(wait):
		return true
	}
}

// Register implements Store: the registration is PREFIX agents/HOST under
// a lease of ttl, the host's at this replica, kept alive by each poll; an
// agent that stops polling (or moves to another replica, which takes it
// over with a lease of its own) lapses with its lease.
func (s *etcdStore) Register(parent context.Context, reg api.AgentRegistration, ttl time.Duration) error {
	data, err := json.Marshal(reg)
	if err != nil {
		return err
	}
	h := fnv.New32a()
	h.Write([]byte(reg.Host))
	mu := &s.hostMu[h.Sum32()%uint32(len(s.hostMu))]
	mu.Lock()
	defer mu.Unlock()
	ctx, cancel := s.ctx(parent)
	defer cancel()
	s.leaseMu.Lock()
	now := time.Now()
	if now.Sub(s.swept) >= time.Second {
		s.swept = now
		for h, l := range s.leases {
			// Lapsed: the agent stopped or polls another replica.
			// Agents gone for good (nodes replaced) would otherwise
			// stay here.
			if now.After(l.until) {
				delete(s.leases, h)
			}
		}
	}
	if l, ok := s.leases[reg.Host]; ok && now.After(l.until) {
		delete(s.leases, reg.Host)
	}
	l, ok := s.leases[reg.Host]
	id := l.id
	s.leaseMu.Unlock()
	if ok {
		if _, err := s.cli.KeepAliveOnce(ctx, id); err != nil {
			ok = false // lapsed (or etcd lost it): a new one
		}
	}
	if !ok {
		l, err := s.cli.Grant(ctx, int64(max(ttl/time.Second, 1)))
		if err != nil {
			return quorumErr(err)
		}
		id = l.ID
	}
	if _, err = s.cli.Put(ctx, s.key("agents", reg.Host), string(data), clientv3.WithLease(id)); err != nil {
		return quorumErr(err)
	}
	s.leaseMu.Lock()
	if s.leases == nil {
		s.leases = map[string]agentLease{}
	}
	s.leases[reg.Host] = agentLease{id, now.Add(ttl)}
	s.leaseMu.Unlock()
	return nil
}

// agentLease is an agent's lease at this replica, and when it lapses
// unless renewed.
type agentLease struct {
	id    clientv3.LeaseID
	until time.Time
}

// Agents implements Store.
func (s *etcdStore) Agents(parent context.Context) ([]api.AgentRegistration, error) {
	ctx, cancel := s.ctx(parent)
	defer cancel()
	resp, err := s.cli.Get(ctx, s.prefix+"agents/", clientv3.WithPrefix())
	if err != nil {
		return nil, quorumErr(err)
	}
	out := []api.AgentRegistration{}
	for _, kv := range resp.Kvs {
		var r api.AgentRegistration
		if err := json.Unmarshal(kv.Value, &r); err != nil {
			return nil, fmt.Errorf("registration %q: %w", kv.Key, err)
		}
		out = append(out, r)
	}
	return out, nil
}

// Close implements Store.
func (s *etcdStore) Close() error {
	s.cancel()
	<-s.done
	if s.probed != nil {
		<-s.probed
	}
	return s.cli.Close()
}
