//go:build kubernetes

package policyserver

// Operator operations as Operation objects (deploy/crds/operations.yaml),
// so that replicas over the Kubernetes API share them as replicas over
// etcd do (etcdops.go). The spec is the request as POST /v1/operations
// takes it; the status is the operation's state, error, reply and times
// (an object without a state is queued). Every change of a status is an
// update conditioned on the object's resourceVersion: of two replicas
// claiming for the same agent, or a report racing the expiry, exactly one
// wins. Creation is refused unless the agent's Lease is live.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sort"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/tools/cache"

	"github.com/dysco/dysco/internal/api"
)

var opsGVR = schema.GroupVersionResource{Group: kubeGroup, Version: kubeVersion, Resource: "operations"}

// kubeOps keeps the operations in Operation objects.
type kubeOps struct {
	st  *kubeStore
	ttl time.Duration // of the agents' registrations

	mu      sync.Mutex
	changed chan struct{}
	store   cache.Store // the objects, as the informer has them
	synced  func() bool
	cancel  context.CancelFunc
	done    chan struct{}
}

var _ opStore = (*kubeOps)(nil)

// kubeOpSpec and kubeOpStatus are an Operation object's halves.
type kubeOpSpec struct {
	Host      string                `json:"host"`
	Reconfig  *api.ReconfigRequest  `json:"reconfig,omitempty"`
	Middlebox *api.MiddleboxRequest `json:"middlebox,omitempty"`
	Query     *api.QueryRequest     `json:"query,omitempty"`
}

type kubeOpStatus struct {
	State    string             `json:"state,omitempty"`
	Error    string             `json:"error,omitempty"`
	Reply    *api.ReconfigReply `json:"reply,omitempty"`
	Sessions *api.SessionsReply `json:"sessions,omitempty"`
	Claimed  time.Time          `json:"claimed,omitzero"`
	Finished time.Time          `json:"finished,omitzero"`
}

func newKubeOps(st *kubeStore, ttl time.Duration) *kubeOps {
	o := &kubeOps{st: st, ttl: ttl, changed: make(chan struct{}), done: make(chan struct{})}
	f := dynamicinformer.NewDynamicSharedInformerFactory(st.dyn, 0)
	inf := f.ForResource(opsGVR).Informer()
	bump := func() {
		o.mu.Lock()
		close(o.changed)
		o.changed = make(chan struct{})
		o.mu.Unlock()
	}
	inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: func(any) { bump() }, UpdateFunc: func(_, _ any) { bump() }, DeleteFunc: func(any) { bump() }})
	o.store, o.synced = inf.GetStore(), inf.HasSynced
	ctx, cancel := context.WithCancel(context.Background())
	o.cancel = cancel
	go func() {
		defer close(o.done)
		f.Start(ctx.Done())
		<-ctx.Done()
		f.Shutdown()
	}()
	return o
}

func (o *kubeOps) close() {
	o.cancel()
	<-o.done
}

func (o *kubeOps) current() <-chan struct{} {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.changed
}

// opOf is the operation an object holds.
func opOf(u *unstructured.Unstructured) (api.Operation, error) {
	var spec kubeOpSpec
	var status kubeOpStatus
	if err := convertField(u, "spec", &spec); err != nil {
		return api.Operation{}, err
	}
	if err := convertField(u, "status", &status); err != nil {
		return api.Operation{}, err
	}
	op := api.Operation{ID: u.GetName(), Host: spec.Host, Reconfig: spec.Reconfig, Middlebox: spec.Middlebox, Query: spec.Query,
		State: status.State, Error: status.Error, Reply: status.Reply, Sessions: status.Sessions,
		Created: u.GetCreationTimestamp().Time, Claimed: status.Claimed, Finished: status.Finished}
	if op.State == "" {
		op.State = api.OpQueued
	}
	return op, nil
}

// convertField decodes u's field (absent: zero) into v through JSON, so
// that the api types' own names and formats apply.
func convertField(u *unstructured.Unstructured, field string, v any) error {
	m, ok := u.Object[field]
	if !ok {
		return nil
	}
	data, err := json.Marshal(m)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(data, v); err != nil {
		return fmt.Errorf("operation %s: %s: %w", u.GetName(), field, err)
	}
	return nil
}

// writeStatus writes op's state into u's status, conditioned on u's
// resourceVersion; ok is false when another change came first.
func (o *kubeOps) writeStatus(ctx context.Context, u *unstructured.Unstructured, op api.Operation) (bool, int, error) {
	st := kubeOpStatus{State: op.State, Error: op.Error, Reply: op.Reply, Sessions: op.Sessions, Claimed: op.Claimed, Finished: op.Finished}
	data, err := json.Marshal(st)
	if err != nil {
		return false, 0, err
	}
	if len(data) > maxEtcdOp {
		return false, http.StatusRequestEntityTooLarge, fmt.Errorf("operation %s: the result takes %d bytes, more than the %d an operation may take", op.ID, len(data), maxEtcdOp)
	}
	var m map[string]any
	json.Unmarshal(data, &m)
	obj := u.DeepCopy()
	obj.Object["status"] = m
	_, err = o.st.dyn.Resource(opsGVR).UpdateStatus(ctx, obj, metav1.UpdateOptions{})
	if apierrors.IsConflict(err) {
		return false, 0, nil
	}
	return err == nil, 0, kubeErr(err)
}

// all is every operation the informer holds, in creation order.
func (o *kubeOps) all() []*unstructured.Unstructured {
	var out []*unstructured.Unstructured
	for _, x := range o.store.List() {
		out = append(out, x.(*unstructured.Unstructured))
	}
	sort.Slice(out, func(i, j int) bool {
		ti, tj := out[i].GetCreationTimestamp(), out[j].GetCreationTimestamp()
		if !ti.Equal(&tj) {
			return ti.Before(&tj)
		}
		return out[i].GetName() < out[j].GetName()
	})
	return out
}

// agentLive tells whether host's Lease is live.
func (o *kubeOps) agentLive(ctx context.Context, host string) (bool, error) {
	l, err := o.st.cs.CoordinationV1().Leases(o.st.ns).Get(ctx, agentLeaseName(host), metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, kubeErr(err)
	}
	end, ok := leaseEnd(l)
	return ok && time.Now().Before(end), nil
}

// create implements opStore.
func (o *kubeOps) create(parent context.Context, op api.Operation) (api.Operation, int, error) {
	if err := o.st.quorumNow(); err != nil {
		return op, 0, err
	}
	ctx, cancel := context.WithTimeout(parent, storeTimeout)
	defer cancel()
	live, err := o.agentLive(ctx, op.Host)
	if err != nil {
		return op, 0, err
	}
	if !live {
		return op, http.StatusConflict, fmt.Errorf("no agent named %q is registered with the policy servers (an agent registers with each policy poll when started with --policy-server, and its registration lapses %s after the last word from it; the name is the agent's --name; `dysco status --cluster` lists them)", op.Host, o.ttl)
	}
	active := 0
	now := time.Now()
	for _, u := range o.all() {
		cur, err := opOf(u)
		if err != nil {
			continue
		}
		switch {
		case !cur.IsFinished():
			active++
		case now.Sub(cur.Finished) > keepFinished:
			// Finished long ago: gone, as the other stores forget them.
			o.st.dyn.Resource(opsGVR).Delete(ctx, u.GetName(), metav1.DeleteOptions{})
		}
	}
	if active >= maxActiveOps {
		return op, http.StatusServiceUnavailable, fmt.Errorf("%d operations are queued or running; try again when some have finished", active)
	}
	data, err := json.Marshal(kubeOpSpec{Host: op.Host, Reconfig: op.Reconfig, Middlebox: op.Middlebox, Query: op.Query})
	if err != nil {
		return op, 0, err
	}
	var spec map[string]any
	json.Unmarshal(data, &spec)
	obj := &unstructured.Unstructured{Object: map[string]any{"apiVersion": kubeGroup + "/" + kubeVersion, "kind": "Operation",
		"metadata": map[string]any{"generateName": "op-", "labels": map[string]any{"dysco.io/host": objectName(op.Host)}}, "spec": spec}}
	made, err := o.st.dyn.Resource(opsGVR).Create(ctx, obj, metav1.CreateOptions{})
	if apierrors.IsInvalid(err) {
		return op, http.StatusBadRequest, err
	}
	if err != nil {
		return op, 0, kubeErr(err)
	}
	out, err := opOf(made)
	return out, 0, err
}

// list implements opStore.
func (o *kubeOps) list(context.Context) ([]api.Operation, error) {
	out := []api.Operation{}
	for _, u := range o.all() {
		if op, err := opOf(u); err == nil {
			expired(&op, time.Now())
			out = append(out, op)
		}
	}
	return out, nil
}

// read gets operation id from the API server (the informer may not have a
// new one yet).
func (o *kubeOps) read(ctx context.Context, id string) (*unstructured.Unstructured, api.Operation, bool, error) {
	u, err := o.st.dyn.Resource(opsGVR).Get(ctx, id, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, api.Operation{}, false, nil
	}
	if err != nil {
		return nil, api.Operation{}, false, kubeErr(err)
	}
	op, err := opOf(u)
	return u, op, err == nil, err
}

// get implements opStore.
func (o *kubeOps) get(parent context.Context, id string) (api.Operation, bool, <-chan struct{}, error) {
	changed := o.current()
	if !validID(id) {
		return api.Operation{}, false, changed, nil
	}
	ctx, cancel := context.WithTimeout(parent, storeTimeout)
	defer cancel()
	for range etcdRetries {
		u, op, ok, err := o.read(ctx, id)
		if err != nil || !ok {
			return api.Operation{}, false, changed, err
		}
		if !expired(&op, time.Now()) {
			return op, true, changed, nil
		}
		if ok, _, err := o.writeStatus(ctx, u, op); err != nil || ok {
			return op, true, changed, err
		}
	}
	return api.Operation{}, false, changed, fmt.Errorf("operation %s changed %d times while it was read; try again", id, etcdRetries)
}

// claimNext implements opStore.
func (o *kubeOps) claimNext(parent context.Context, host string) (api.Operation, bool, <-chan struct{}, error) {
	changed := o.current()
	if err := o.st.quorumNow(); err != nil {
		return api.Operation{}, false, changed, err
	}
	if !o.synced() || parent.Err() != nil {
		return api.Operation{}, false, changed, nil
	}
	ctx, cancel := context.WithTimeout(parent, storeTimeout)
	defer cancel()
	for _, u := range o.all() {
		op, err := opOf(u)
		if err != nil || op.Host != host || op.State != api.OpQueued {
			continue
		}
		now := time.Now()
		if expired(&op, now) {
			o.writeStatus(ctx, u, op)
			continue
		}
		op.State, op.Claimed = api.OpRunning, now
		ok, _, err := o.writeStatus(ctx, u, op)
		if err != nil {
			return api.Operation{}, false, changed, err
		}
		if ok {
			return op, true, nil, nil
		}
		// Another replica claimed it first (or the informer was behind):
		// the next change wakes the caller.
	}
	return api.Operation{}, false, changed, nil
}

// report implements opStore.
func (o *kubeOps) report(parent context.Context, id string, res api.OperationResult, caller string) (int, error) {
	if !validID(id) {
		return http.StatusNotFound, fmt.Errorf("no operation %q here", id)
	}
	ctx, cancel := context.WithTimeout(parent, storeTimeout)
	defer cancel()
	for range etcdRetries {
		u, op, ok, err := o.read(ctx, id)
		if err != nil {
			return 0, err
		}
		if !ok {
			return http.StatusNotFound, fmt.Errorf("no operation %q here", id)
		}
		before := op.State
		now := time.Now()
		expired(&op, now)
		code, ferr := finishWith(&op, id, res, caller, now)
		if ferr != nil && op.State == before {
			return code, ferr
		}
		ok, wcode, err := o.writeStatus(ctx, u, op)
		if err != nil {
			return wcode, err
		}
		if ok {
			return code, ferr
		}
	}
	return 0, fmt.Errorf("operation %s changed %d times while it was reported; try again", id, etcdRetries)
}

// polling implements opStore: an agent's liveness is its Lease.
func (o *kubeOps) polling(string, bool) {}
