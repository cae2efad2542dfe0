//go:build kubernetes

package policyserver

// The policy set in Kubernetes custom resources (docs/kubernetes.md):
// Policy and MiddleboxType objects (deploy/crds) are what operators write,
// with kubectl or through any replica's API. One replica at a time, elected
// with a coordination Lease, is the controller: it checks every object (the
// schema has checked what a schema can; the filter's syntax needs libpcap),
// resolves node and pod selectors, writes each object's Accepted condition,
// and publishes the accepted set into one ConfigMap, dysco-policy-set,
// whose resourceVersion is the set's version. Every replica watches that
// ConfigMap and serves it to the agents. One writer gives the versions one
// order across replicas; the resourceVersions of the objects alone would
// not (a deletion leaves nothing to read a version from).

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"reflect"
	"slices"
	"strconv"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"

	"k8s.io/klog/v2"

	"github.com/dysco/dysco/internal/api"
)

var (
	policiesGVR = schema.GroupVersionResource{Group: kubeGroup, Version: kubeVersion, Resource: "policies"}
	typesGVR    = schema.GroupVersionResource{Group: kubeGroup, Version: kubeVersion, Resource: "middleboxtypes"}
)

// Names of the objects the replicas share in their namespace.
const (
	kubeSetName    = "dysco-policy-set"
	kubeAgentLabel = "dysco.io/agent"
	// An agent's Lease's annotations: its address and applied version.
	kubeAddrAnn    = "dysco.io/addr"
	kubeAppliedAnn = "dysco.io/applied"
	kubeVersionAnn = "dysco.io/version"
	kubeHostAnn    = "dysco.io/host"
)

// KubeSupport tells whether this build has the Kubernetes store.
const KubeSupport = true

// openKube keeps the server's set in Kubernetes objects (Config.Kubernetes).
func (s *Server) openKube(cfg Config) error {
	rc, err := kubeRESTConfig(cfg.Kubeconfig)
	if err != nil {
		return err
	}
	ns := cfg.KubeNamespace
	if ns == "" {
		ns = DefaultKubeNamespace
	}
	keep := cfg.ExpiredAgentKeep
	if keep <= 0 {
		keep = defaultExpiredAgentKeep
	}
	st, err := openKubeStore(rc, ns, cfg.KubeLease, keep, cfg.Logger, func() {
		select {
		case s.storeChanged <- struct{}{}:
		default:
		}
	}, s.wake, s.loadSet, cfg.ValidatePolicy) // a replica losing the API server ends the waiting polls, as over etcd
	if err != nil {
		return err
	}
	s.st = st
	s.ops = newKubeOps(st, s.agentTTL())
	s.following = make(chan struct{})
	go s.followStore()
	return nil
}

// kubeRESTConfig is the API server of the kubeconfig file path, or, when
// path is empty, of the pod's service account.
func kubeRESTConfig(path string) (*rest.Config, error) {
	if path == "" {
		c, err := rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("kubernetes: %w (outside a pod, give --kubeconfig)", err)
		}
		return c, nil
	}
	c, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		return nil, fmt.Errorf("kubernetes: kubeconfig %s: %w", path, err)
	}
	return c, nil
}

// defaultKubeLease is the controller's leader lease by default; the
// leader renews it within two thirds of it, and candidates retry every
// seventh.
const defaultKubeLease = 15 * time.Second

// kubeQPS and kubeRegQPS are the request rates (with bursts of twice as
// many) of a replica's two clients of the API server.
const (
	kubeQPS    = 50
	kubeRegQPS = 25
)

// kubeStore keeps the policy set in Kubernetes objects.
type kubeStore struct {
	cs       kubernetes.Interface
	dyn      dynamic.Interface
	ns       string
	id       string
	log      *slog.Logger
	onChange func()
	// onLoad receives the published set once this replica has read it,
	// at start or, with the API server unreachable then, later.
	onLoad func(api.PolicySet)
	lease  time.Duration
	// keep is how long the controller leaves an expired agent's Lease
	// before it deletes it.
	keep time.Duration
	// check is the server's check of a policy's filter (libpcap); nil
	// for none.
	check func(api.Policy) error

	mu  sync.Mutex
	cur api.PolicySet

	// The agents' registrations waiting to be written (latest per
	// host), and what was last written of each (the registrar's own).
	regCS      kubernetes.Interface
	regMu      sync.Mutex
	regPending map[string]leaseWrite
	regKick    chan struct{}
	regWritten map[string]*coordinationv1.Lease

	storeHealth
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

var _ Store = (*kubeStore)(nil)

// openKubeStore connects to the API server of cfg, in namespace ns, and
// starts following the published set and campaigning to be the controller.
func openKubeStore(cfg *rest.Config, ns string, lease, keep time.Duration, log *slog.Logger, onChange, onHealth func(), onLoad func(api.PolicySet), check func(api.Policy) error) (*kubeStore, error) {
	if lease <= 0 {
		lease = defaultKubeLease
	}
	// client-go logs through klog: to the server's log instead of stderr.
	klog.SetSlogLogger(log.With("component", "client-go"))
	// client-go's own limit (5 requests a second) would queue the
	// publication of a change behind the agents' registrations: the set,
	// the controller and the operations get a client of their own, and
	// the registrations (coalesced, see registrar) another.
	cfg = rest.CopyConfig(cfg)
	cfg.QPS, cfg.Burst = kubeQPS, 2*kubeQPS
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("kubernetes: %w", err)
	}
	rcfg := rest.CopyConfig(cfg)
	rcfg.QPS, rcfg.Burst = kubeRegQPS, 2*kubeRegQPS
	regCS, err := kubernetes.NewForConfig(rcfg)
	if err != nil {
		return nil, fmt.Errorf("kubernetes: %w", err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("kubernetes: %w", err)
	}
	host, _ := os.Hostname()
	s := &kubeStore{cs: cs, dyn: dyn, ns: ns, id: fmt.Sprintf("%s-%d-%d", host, os.Getpid(), time.Now().UnixNano()), log: log, onChange: onChange, onLoad: onLoad, check: check, lease: lease, keep: keep}
	s.onHealth = onHealth
	s.regCS, s.regPending, s.regWritten, s.regKick = regCS, map[string]leaseWrite{}, map[string]*coordinationv1.Lease{}, make(chan struct{}, 1)
	ctx, cancel := context.WithTimeout(context.Background(), storeTimeout)
	defer cancel()
	s.lost, s.kube = "this policy server cannot reach the API server", true
	// The CRDs must be installed: say so at once rather than serve
	// nothing. An API server that does not answer at all may be starting
	// too: the replica starts unhealthy, and reads the set when it can.
	var status apierrors.APIStatus
	_, err = dyn.Resource(policiesGVR).List(ctx, metav1.ListOptions{Limit: 1})
	if errors.As(err, &status) {
		return nil, fmt.Errorf("kubernetes: listing %s: %w (are the CRDs of deploy/crds installed, and may this server's account read them?)", policiesGVR.GroupResource(), err)
	}
	if err == nil {
		var cm *corev1.ConfigMap
		cm, err = cs.CoreV1().ConfigMaps(ns).Get(ctx, kubeSetName, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			err = nil
		case errors.As(err, &status):
			return nil, fmt.Errorf("kubernetes: %w", err)
		case err == nil:
			s.setFrom(cm)
		}
	}
	if err != nil {
		log.Warn("kubernetes: the API server does not answer at start; this replica answers 503 until it has read the published set", "err", err)
	} else {
		if onLoad != nil {
			onLoad(s.current())
		}
		s.loaded.Store(true)
		s.ok.Store(true)
	}
	rctx, rcancel := context.WithCancel(context.Background())
	s.cancel = rcancel
	s.wg.Add(4)
	go func() { defer s.wg.Done(); s.registrar(rctx) }()
	go func() { defer s.wg.Done(); s.follow(rctx) }()
	go func() { defer s.wg.Done(); s.campaign(rctx) }()
	go func() { defer s.wg.Done(); s.probe(rctx) }()
	return s, nil
}

// setFrom takes the set published in cm, if it is newer than the one held.
func (s *kubeStore) setFrom(cm *corev1.ConfigMap) {
	v, err := strconv.ParseUint(cm.ResourceVersion, 10, 64)
	if err != nil {
		s.log.Warn("kubernetes: the published set has a resourceVersion that is not a number; ignored", "rv", cm.ResourceVersion)
		return
	}
	var set api.PolicySet
	if err := json.Unmarshal([]byte(cm.Data["set"]), &set); err != nil {
		s.log.Warn("kubernetes: the published set is not a policy set; ignored", "err", err)
		return
	}
	set.Version = v
	s.mu.Lock()
	newer := v > s.cur.Version
	if newer {
		s.cur = set
	}
	s.mu.Unlock()
	if newer && s.onChange != nil {
		s.onChange()
	}
}

// follow watches the published set. A replica that could not read it at
// start reads it from the informer's first list, hands it to onLoad, and
// only then is loaded.
func (s *kubeStore) follow(ctx context.Context) {
	lw := cache.NewListWatchFromClient(s.cs.CoreV1().RESTClient(), "configmaps", s.ns, fields.OneTermEqualSelector("metadata.name", kubeSetName))
	inf := cache.NewSharedIndexInformer(lw, &corev1.ConfigMap{}, 0, cache.Indexers{})
	inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { s.setFrom(o.(*corev1.ConfigMap)) },
		UpdateFunc: func(_, o any) { s.setFrom(o.(*corev1.ConfigMap)) },
	})
	if !s.loaded.Load() {
		go func() {
			if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
				return
			}
			for _, o := range inf.GetStore().List() {
				s.setFrom(o.(*corev1.ConfigMap))
			}
			set := s.current()
			if s.onLoad != nil {
				s.onLoad(set)
			}
			s.loaded.Store(true)
			s.log.Info("kubernetes: published set read", "version", set.Version, "policies", len(set.Policies), "types", len(set.Types))
		}()
	}
	inf.Run(ctx.Done())
}

// probe checks every probeEvery that the API server answers.
func (s *kubeStore) probe(ctx context.Context) {
	t := time.NewTicker(probeEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		pctx, cancel := context.WithTimeout(ctx, storeTimeout)
		_, err := s.cs.CoreV1().ConfigMaps(s.ns).Get(pctx, kubeSetName, metav1.GetOptions{})
		cancel()
		if ctx.Err() != nil {
			return
		}
		ok := (err == nil || apierrors.IsNotFound(err)) && s.loaded.Load()
		if was := s.set(ok); was != ok {
			s.log.Warn("kubernetes: API server reachable", "ok", ok, "err", err)
		}
	}
}

// campaign runs for leadership until ctx ends, and controls while leading.
func (s *kubeStore) campaign(ctx context.Context) {
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Name: KubeControllerLease, Namespace: s.ns},
		Client:     s.cs.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: s.id},
	}
	for ctx.Err() == nil {
		leaderelection.RunOrDie(ctx, leaderelection.LeaderElectionConfig{
			Lock: lock, LeaseDuration: s.lease, RenewDeadline: s.lease * 2 / 3, RetryPeriod: s.lease / 7,
			ReleaseOnCancel: true, Name: KubeControllerLease,
			Callbacks: leaderelection.LeaderCallbacks{
				OnStartedLeading: func(lctx context.Context) {
					s.log.Info("kubernetes: this replica controls the policy set")
					s.control(lctx)
				},
				OnStoppedLeading: func() {
					s.log.Info("kubernetes: this replica no longer controls the policy set")
				},
			},
		})
	}
}

// control is the leader's loop: it reconciles the published set with the
// objects whenever one of them (or a node, or a pod) changes.
func (s *kubeStore) control(ctx context.Context) {
	trigger := make(chan struct{}, 1)
	kick := func() {
		select {
		case trigger <- struct{}{}:
		default:
		}
	}
	handler := cache.ResourceEventHandlerFuncs{AddFunc: func(any) { kick() }, UpdateFunc: func(_, _ any) { kick() }, DeleteFunc: func(any) { kick() }}
	dynf := dynamicinformer.NewDynamicSharedInformerFactory(s.dyn, 0)
	pols, typs := dynf.ForResource(policiesGVR), dynf.ForResource(typesGVR)
	pols.Informer().AddEventHandler(handler)
	typs.Informer().AddEventHandler(handler)
	f := informers.NewSharedInformerFactory(s.cs, 0)
	nodes, pods := f.Core().V1().Nodes(), f.Core().V1().Pods()
	nodes.Informer().AddEventHandler(handler)
	pods.Informer().AddEventHandler(handler)
	dynf.Start(ctx.Done())
	f.Start(ctx.Done())
	defer dynf.Shutdown()
	defer f.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), pols.Informer().HasSynced, typs.Informer().HasSynced, nodes.Informer().HasSynced, pods.Informer().HasSynced) {
		return
	}
	kick()
	sweep := time.NewTicker(min(s.keep/2, time.Minute))
	defer sweep.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-sweep.C:
			s.sweepAgents(ctx)
			continue
		case <-trigger:
		}
		// Changes come in bursts (a kubectl apply of many objects).
		select {
		case <-ctx.Done():
			return
		case <-time.After(20 * time.Millisecond):
		}
		src := kubeSources{policies: pols.Informer().GetStore().List(), types: typs.Informer().GetStore().List()}
		for _, n := range nodes.Informer().GetStore().List() {
			n := n.(*corev1.Node)
			src.nodes = append(src.nodes, kubeNode{Name: n.Name, Labels: n.Labels})
		}
		for _, p := range pods.Informer().GetStore().List() {
			src.pods = append(src.pods, podOf(p.(*corev1.Pod)))
		}
		if err := s.reconcile(ctx, src); err != nil && ctx.Err() == nil {
			s.log.Warn("kubernetes: publishing the policy set failed; trying again", "err", err)
			time.AfterFunc(500*time.Millisecond, kick)
		}
	}
}

// kubeSources are the objects a reconciliation reads.
type kubeSources struct {
	policies, types []any // *unstructured.Unstructured
	nodes           []kubeNode
	pods            []kubePod
}

// podOf is what the translation needs of p.
func podOf(p *corev1.Pod) kubePod {
	kp := kubePod{Namespace: p.Namespace, Labels: p.Labels}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
			kp.Ready = p.DeletionTimestamp == nil
		}
	}
	for _, ip := range p.Status.PodIPs {
		if a, err := netipParse(ip.IP); err == nil {
			kp.IPs = append(kp.IPs, a)
		}
	}
	return kp
}

// verdict is the acceptance of one object by a reconciliation.
type verdict struct {
	obj    *unstructured.Unstructured
	gvr    schema.GroupVersionResource
	ok     bool
	reason string
	msg    string
}

// reconcile builds the accepted set from src, publishes it if it differs
// from the published one, and writes each object's Accepted condition.
func (s *kubeStore) reconcile(ctx context.Context, src kubeSources) error {
	set, verdicts := s.accept(src)
	data, err := json.Marshal(api.PolicySet{Policies: set.Policies, Types: set.Types})
	if err != nil {
		return err
	}
	if err := s.publishSet(ctx, string(data)); err != nil {
		return err
	}
	for _, v := range verdicts {
		s.writeCondition(ctx, v)
	}
	return nil
}

// accept checks every object of src and returns the set of those accepted,
// in the server's order, with a verdict per object.
func (s *kubeStore) accept(src kubeSources) (api.PolicySet, []verdict) {
	set := api.PolicySet{Policies: []api.Policy{}, Types: []api.MiddleboxType{}}
	var out []verdict
	inForce := map[string]bool{}
	for _, o := range src.types {
		u := o.(*unstructured.Unstructured)
		v := verdict{obj: u, gvr: typesGVR}
		var spec kubeTypeSpec
		err := fromUnstructuredSpec(u, &spec)
		var t api.MiddleboxType
		if err == nil {
			t, err = typeFromKube(u.GetName(), spec, src.pods)
		}
		switch {
		case errors.Is(err, errNoInstance):
			v.reason, v.msg = "NoInstance", "held back: "+err.Error()
		case err != nil:
			v.reason, v.msg = "Invalid", err.Error()
		case len(set.Types) >= api.MaxTypes:
			v.reason, v.msg = "TooMany", fmt.Sprintf("held back: the policy set holds at most %d types", api.MaxTypes)
		default:
			v.ok, v.reason, v.msg = true, "Accepted", fmt.Sprintf("%d instances", len(t.Instances))
			set.Types = append(set.Types, t)
			inForce[t.Name] = true
		}
		out = append(out, v)
	}
	for _, o := range src.policies {
		u := o.(*unstructured.Unstructured)
		v := verdict{obj: u, gvr: policiesGVR}
		var spec kubePolicySpec
		err := fromUnstructuredSpec(u, &spec)
		var p api.Policy
		if err == nil {
			p, err = policyFromKube(u.GetName(), spec, src.nodes)
		}
		if err == nil && s.check != nil {
			err = s.check(p)
		}
		missing := ""
		for _, h := range p.Chain {
			if h.Type != "" && !inForce[h.Type] && missing == "" {
				missing = h.Type
			}
		}
		switch {
		case errors.Is(err, errNoNode):
			v.reason, v.msg = "NoNode", "held back: "+err.Error()
		case err != nil:
			v.reason, v.msg = "Invalid", err.Error()
		case missing != "":
			v.reason, v.msg = "TypeNotInForce", fmt.Sprintf("held back: middlebox type %q is not in force", missing)
		case len(set.Policies) >= api.MaxStoredPolicies:
			v.reason, v.msg = "TooMany", fmt.Sprintf("held back: the policy set holds at most %d policies", api.MaxStoredPolicies)
		default:
			v.ok, v.reason, v.msg = true, "Accepted", ""
			set.Policies = append(set.Policies, p)
		}
		out = append(out, v)
	}
	sortSet(&set)
	return set, out
}

// fromUnstructuredSpec decodes u's spec into spec.
func fromUnstructuredSpec(u *unstructured.Unstructured, spec any) error {
	m, _, err := unstructured.NestedMap(u.Object, "spec")
	if err != nil {
		return fmt.Errorf("%s %q: spec: %w", u.GetKind(), u.GetName(), err)
	}
	return runtime.DefaultUnstructuredConverter.FromUnstructured(m, spec)
}

// publishSet writes data as the published set, unless it is published
// already.
func (s *kubeStore) publishSet(ctx context.Context, data string) error {
	cms := s.cs.CoreV1().ConfigMaps(s.ns)
	cm, err := cms.Get(ctx, kubeSetName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		cm = &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: kubeSetName, Labels: map[string]string{"app.kubernetes.io/part-of": "dysco"}},
			Data: map[string]string{"set": data}}
		_, err = cms.Create(ctx, cm, metav1.CreateOptions{})
		return err
	}
	if err != nil {
		return err
	}
	if cm.Data["set"] == data {
		return nil
	}
	if cm.Data == nil {
		cm.Data = map[string]string{}
	}
	cm.Data["set"] = data
	// The Get's resourceVersion is the precondition: a stale leader's
	// write fails.
	_, err = cms.Update(ctx, cm, metav1.UpdateOptions{})
	return err
}

// writeCondition sets v's Accepted condition on its object, if it changed.
func (s *kubeStore) writeCondition(ctx context.Context, v verdict) {
	status := metav1.ConditionFalse
	if v.ok {
		status = metav1.ConditionTrue
	}
	gen := v.obj.GetGeneration()
	conds, _, _ := unstructured.NestedSlice(v.obj.Object, "status", "conditions")
	for _, c := range conds {
		m, _ := c.(map[string]any)
		if m["type"] == "Accepted" && m["status"] == string(status) && m["reason"] == v.reason && m["message"] == v.msg && m["observedGeneration"] == gen {
			return
		}
	}
	obj := v.obj.DeepCopy()
	cond := map[string]any{"type": "Accepted", "status": string(status), "reason": v.reason, "message": v.msg,
		"observedGeneration": gen, "lastTransitionTime": time.Now().UTC().Format(time.RFC3339)}
	if err := unstructured.SetNestedSlice(obj.Object, []any{cond}, "status", "conditions"); err != nil {
		return
	}
	unstructured.SetNestedField(obj.Object, gen, "status", "observedGeneration")
	if _, err := s.dyn.Resource(v.gvr).UpdateStatus(ctx, obj, metav1.UpdateOptions{}); err != nil && !apierrors.IsConflict(err) && ctx.Err() == nil {
		s.log.Debug("kubernetes: writing a status failed", "object", obj.GetName(), "err", err)
	}
}

// Load implements Store: the set last published.
func (s *kubeStore) Load(context.Context) (api.PolicySet, error) { return s.current(), nil }

// current is the set last published.
func (s *kubeStore) current() api.PolicySet {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cur
}

// kubeErr turns an API server that cannot be reached into a
// *NoQuorumError.
func kubeErr(err error) error {
	if err == nil {
		return nil
	}
	// A *url.Error is a request that got no answer: refused, reset,
	// no route, a handshake that failed.
	var ue *url.Error
	if apierrors.IsServerTimeout(err) || apierrors.IsTimeout(err) || apierrors.IsServiceUnavailable(err) ||
		errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ue) {
		return &NoQuorumError{Err: err, Kube: true}
	}
	return err
}

// putObject creates or updates the object name of gvr with spec (a
// pointer to a kube*Spec); limit
// bounds the objects of the kind.
func (s *kubeStore) putObject(parent context.Context, gvr schema.GroupVersionResource, kind, name string, spec any, limit int, what string) (bool, error) {
	ctx, cancel := context.WithTimeout(parent, storeTimeout)
	defer cancel()
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(spec)
	if err != nil {
		return false, err
	}
	res := s.dyn.Resource(gvr)
	cur, err := res.Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		list, err := res.List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, kubeErr(err)
		}
		if len(list.Items) >= limit {
			return false, &FullError{Kind: what, Limit: limit}
		}
		obj := &unstructured.Unstructured{Object: map[string]any{"apiVersion": kubeGroup + "/" + kubeVersion, "kind": kind,
			"metadata": map[string]any{"name": name}, "spec": m}}
		if obj, err = res.Create(ctx, obj, metav1.CreateOptions{}); err != nil {
			return false, kubeErr(err)
		}
		return true, s.awaitAccepted(parent, gvr, kind, name, obj.GetGeneration())
	case err != nil:
		return false, kubeErr(err)
	}
	old, _, _ := unstructured.NestedMap(cur.Object, "spec")
	if reflect.DeepEqual(old, m) {
		// Unchanged, but perhaps not published yet (a write retried
		// after no controller took it): the same wait.
		return false, s.awaitAccepted(parent, gvr, kind, name, cur.GetGeneration())
	}
	cur.Object["spec"] = m
	if cur, err = res.Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
		return false, kubeErr(err)
	}
	return true, s.awaitAccepted(parent, gvr, kind, name, cur.GetGeneration())
}

// awaitAccepted waits until the controller has judged generation gen of
// the object: when it accepted it, until this replica serves a set that
// holds it, so that a write through a replica returns once the agents can
// have it (like the other stores' writes); when it held it back, the
// reason, as an *UnpublishedError.
func (s *kubeStore) awaitAccepted(parent context.Context, gvr schema.GroupVersionResource, kind, name string, gen int64) error {
	var want uint64 // the published set's version to wait for, once known
	held := func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.cur.Version >= want
	}
	return s.awaitPublished(parent, kind, name, func(ctx context.Context) (bool, error) {
		if want != 0 {
			return held(), nil
		}
		obj, err := s.dyn.Resource(gvr).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		observed, ok, reason, msg := acceptedOf(obj)
		if observed < gen {
			return false, nil
		}
		if !ok {
			return false, &UnpublishedError{Kind: kind, Name: name, Reason: reason, Message: msg}
		}
		// The controller publishes before it writes the conditions:
		// the set now published holds the object.
		cm, err := s.cs.CoreV1().ConfigMaps(s.ns).Get(ctx, kubeSetName, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		if want, err = strconv.ParseUint(cm.ResourceVersion, 10, 64); err != nil {
			return false, fmt.Errorf("kubernetes: the published set's resourceVersion %q: %w", cm.ResourceVersion, err)
		}
		return held(), nil
	})
}

// awaitPublished calls step every 50 ms until it is done or fails, for
// at most kubePublishWait: then the object is not published.
func (s *kubeStore) awaitPublished(parent context.Context, kind, name string, step func(context.Context) (bool, error)) error {
	ctx, cancel := context.WithTimeout(parent, kubePublishWait)
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		if done, err := step(ctx); done || err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			if parent.Err() != nil {
				return parent.Err()
			}
			return &UnpublishedError{Kind: kind, Name: name}
		case <-tick.C:
		}
	}
}

// acceptedOf is obj's Accepted condition: the generation it judged, and
// its verdict.
func acceptedOf(obj *unstructured.Unstructured) (observed int64, ok bool, reason, msg string) {
	conds, _, _ := unstructured.NestedSlice(obj.Object, "status", "conditions")
	for _, c := range conds {
		m, _ := c.(map[string]any)
		if m["type"] != "Accepted" {
			continue
		}
		observed, _ = m["observedGeneration"].(int64)
		reason, _ = m["reason"].(string)
		msg, _ = m["message"].(string)
		return observed, m["status"] == string(metav1.ConditionTrue), reason, msg
	}
	return 0, false, "", ""
}

// awaitGone waits until this replica serves a set without the object
// name of kind, once deleted (as awaitAccepted).
func (s *kubeStore) awaitGone(parent context.Context, kind, name string) error {
	return s.awaitPublished(parent, kind, name, func(context.Context) (bool, error) {
		s.mu.Lock()
		defer s.mu.Unlock()
		if kind == "Policy" {
			return !slices.ContainsFunc(s.cur.Policies, func(p api.Policy) bool { return p.Name == name }), nil
		}
		return !slices.ContainsFunc(s.cur.Types, func(t api.MiddleboxType) bool { return t.Name == name }), nil
	})
}

// PutPolicy implements Store.
func (s *kubeStore) PutPolicy(ctx context.Context, p api.Policy) (bool, error) {
	spec := policyToKube(p)
	return s.putObject(ctx, policiesGVR, "Policy", p.Name, &spec, api.MaxStoredPolicies, "policies")
}

// PutType implements Store.
func (s *kubeStore) PutType(ctx context.Context, t api.MiddleboxType) (bool, error) {
	spec := typeToKube(t)
	return s.putObject(ctx, typesGVR, "MiddleboxType", t.Name, &spec, api.MaxTypes, "middlebox types")
}

// DeletePolicy implements Store.
func (s *kubeStore) DeletePolicy(parent context.Context, name string) (bool, error) {
	ctx, cancel := context.WithTimeout(parent, storeTimeout)
	defer cancel()
	err := s.dyn.Resource(policiesGVR).Delete(ctx, name, metav1.DeleteOptions{})
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, kubeErr(err)
	}
	return true, s.awaitGone(parent, "Policy", name)
}

// DeleteType implements Store: refused while a Policy names the type.
func (s *kubeStore) DeleteType(parent context.Context, name string) (bool, error) {
	ctx, cancel := context.WithTimeout(parent, storeTimeout)
	defer cancel()
	list, err := s.dyn.Resource(policiesGVR).List(ctx, metav1.ListOptions{})
	if err != nil {
		return false, kubeErr(err)
	}
	var users []string
	for _, u := range list.Items {
		var spec kubePolicySpec
		if fromUnstructuredSpec(&u, &spec) != nil {
			continue
		}
		for _, h := range spec.Chain {
			if h.Type == name {
				users = append(users, u.GetName())
				break
			}
		}
	}
	if _, err := s.dyn.Resource(typesGVR).Get(ctx, name, metav1.GetOptions{}); apierrors.IsNotFound(err) {
		return false, nil
	}
	if len(users) > 0 {
		return true, &api.TypeInUseError{Type: name, Policies: users}
	}
	err = s.dyn.Resource(typesGVR).Delete(ctx, name, metav1.DeleteOptions{})
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, kubeErr(err)
	}
	return true, s.awaitGone(parent, "MiddleboxType", name)
}

// agentLeaseName is the Lease of agent host: a valid object name (lower
// case, at most 63) that tells hosts apart even when their names differ
// only in what a Lease's name cannot hold.
func agentLeaseName(host string) string {
	return "dysco-agent-" + objectName(host)
}

// leaseWrite is a registration to write, with its lifetime.
type leaseWrite struct {
	reg api.AgentRegistration
	ttl time.Duration
}

// Register implements Store: the agent's Lease, written by the registrar
// in the background. Every poll registers; 50 agents taking a change at
// once would otherwise be 50 writes to the API server per change.
func (s *kubeStore) Register(_ context.Context, reg api.AgentRegistration, ttl time.Duration) error {
	s.regMu.Lock()
	s.regPending[reg.Host] = leaseWrite{reg, ttl}
	s.regMu.Unlock()
	select {
	case s.regKick <- struct{}{}:
	default:
	}
	return nil
}

// kubeRegMinInterval is the least time between two writes of one agent's
// Lease for a new applied version, address or agent version: `dysco
// status --cluster` may lag by that much. A renewal alone waits for a
// third of the TTL.
const kubeRegMinInterval = time.Second

// registrar writes the registrations that are due: an agent's first at
// once, a new applied version, address or agent version after
// kubeRegMinInterval, a renewal after a third of its TTL. The others wait
// for their turn.
func (s *kubeStore) registrar(ctx context.Context) {
	tick := time.NewTicker(kubeRegMinInterval / 4)
	defer tick.Stop()
	var pruned time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.regKick:
		case <-tick.C:
		}
		now := time.Now()
		if now.Sub(pruned) > time.Second {
			s.forgetExpired(now)
			pruned = now
		}
		var due []leaseWrite
		s.regMu.Lock()
		for host, w := range s.regPending {
			l := s.regWritten[host] // the Lease last written, with what it says
			if l == nil || now.Sub(l.Spec.RenewTime.Time) >= regWait(l, w) {
				due = append(due, w)
				delete(s.regPending, host)
			}
		}
		s.regMu.Unlock()
		for i, w := range due {
			err := s.writeLease(ctx, w)
			if err == nil {
				continue
			}
			s.log.Debug("kubernetes: cannot register the agent", "host", w.reg.Host, "err", err)
			// Put back what is not newer in the queue, and try later.
			s.regMu.Lock()
			for _, w := range due[i:] {
				if _, ok := s.regPending[w.reg.Host]; !ok {
					s.regPending[w.reg.Host] = w
				}
			}
			s.regMu.Unlock()
			break
		}
	}
}

// forgetExpired drops what the registrar remembers of the Leases it wrote
// that have expired since, for agents with nothing to write: agents that
// stopped for good (nodes replaced) would otherwise be kept for ever. The
// next registration of such an agent reads its Lease first.
func (s *kubeStore) forgetExpired(now time.Time) {
	s.regMu.Lock()
	defer s.regMu.Unlock()
	for host, l := range s.regWritten {
		if _, pending := s.regPending[host]; pending {
			continue
		}
		if end, ok := leaseEnd(l); !ok || now.After(end) {
			delete(s.regWritten, host)
		}
	}
}

// leaseEnd is when l expires, unless it says nothing of its lifetime.
func leaseEnd(l *coordinationv1.Lease) (time.Time, bool) {
	if l.Spec.RenewTime == nil || l.Spec.LeaseDurationSeconds == nil {
		return time.Time{}, false
	}
	return l.Spec.RenewTime.Add(time.Duration(*l.Spec.LeaseDurationSeconds) * time.Second), true
}

// defaultExpiredAgentKeep is how long an expired agent's Lease stays, by
// default: as long as a finished operation.
const defaultExpiredAgentKeep = keepFinished

// sweepAgents deletes the agents' Leases that expired more than s.keep
// ago (the controller's, so one replica does it): in a cluster whose nodes
// come and go, the Leases of the nodes gone would otherwise pile up. Each
// delete is conditioned on the Lease read, so an agent that came back
// meanwhile keeps its renewed Lease.
func (s *kubeStore) sweepAgents(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	leases := s.cs.CoordinationV1().Leases(s.ns)
	list, err := leases.List(ctx, metav1.ListOptions{LabelSelector: kubeAgentLabel + "=true"})
	if err != nil {
		s.log.Debug("kubernetes: cannot list the agents' Leases", "err", err)
		return
	}
	now := time.Now()
	for _, l := range list.Items {
		end, ok := leaseEnd(&l)
		if ok && now.Sub(end) < s.keep {
			continue
		}
		rv := l.ResourceVersion
		err := leases.Delete(ctx, l.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{ResourceVersion: &rv}})
		switch {
		case err == nil:
			s.log.Info("kubernetes: deleted the Lease of an agent gone", "host", l.Annotations[kubeHostAnn], "expired", end.UTC().Format(time.RFC3339))
		case apierrors.IsConflict(err) || apierrors.IsNotFound(err):
		default:
			s.log.Debug("kubernetes: cannot delete an agent's Lease", "lease", l.Name, "err", err)
		}
	}
}

// regWait is how long after l was written w is due: a new applied
// version, address or agent version after kubeRegMinInterval, a renewal
// alone after a third of the TTL.
func regWait(l *coordinationv1.Lease, w leaseWrite) time.Duration {
	if l.Annotations[kubeAppliedAnn] != strconv.FormatUint(w.reg.Applied, 10) || l.Annotations[kubeAddrAnn] != w.reg.Addr ||
		l.Annotations[kubeVersionAnn] != w.reg.Version {
		return kubeRegMinInterval
	}
	return w.ttl / 3
}

// writeLease writes w as its agent's Lease: an update of the Lease last
// written when there is one (no read first), else a read and a create or
// an update.
func (s *kubeStore) writeLease(parent context.Context, w leaseWrite) error {
	ctx, cancel := context.WithTimeout(parent, storeTimeout)
	defer cancel()
	reg := w.reg
	leases := s.regCS.CoordinationV1().Leases(s.ns)
	name := agentLeaseName(reg.Host)
	secs := int32(max(w.ttl/time.Second, 1))
	now := metav1.NewMicroTime(time.Now())
	ann := map[string]string{kubeHostAnn: reg.Host, kubeAddrAnn: reg.Addr, kubeAppliedAnn: strconv.FormatUint(reg.Applied, 10), kubeVersionAnn: reg.Version}
	set := func(l *coordinationv1.Lease) {
		l.Annotations = ann
		l.Spec.HolderIdentity, l.Spec.LeaseDurationSeconds, l.Spec.RenewTime = &reg.Host, &secs, &now
	}
	done := func(l *coordinationv1.Lease) error {
		s.regWritten[reg.Host] = l
		return nil
	}
	if last := s.regWritten[reg.Host]; last != nil {
		l := last.DeepCopy()
		set(l)
		got, err := leases.Update(ctx, l, metav1.UpdateOptions{})
		if err == nil {
			return done(got)
		}
		// Renewed by another replica, or deleted: read it again.
		if !apierrors.IsConflict(err) && !apierrors.IsNotFound(err) {
			return kubeErr(err)
		}
	}
	l, err := leases.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		l = &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{kubeAgentLabel: "true"}},
			Spec: coordinationv1.LeaseSpec{AcquireTime: &now}}
		set(l)
		got, err := leases.Create(ctx, l, metav1.CreateOptions{})
		if err != nil {
			return kubeErr(err)
		}
		return done(got)
	}
	if err != nil {
		return kubeErr(err)
	}
	set(l)
	got, err := leases.Update(ctx, l, metav1.UpdateOptions{})
	if apierrors.IsConflict(err) {
		return nil // another replica renewed it just now
	}
	if err != nil {
		return kubeErr(err)
	}
	return done(got)
}

// Agents implements Store: the agents whose Leases have not expired.
func (s *kubeStore) Agents(parent context.Context) ([]api.AgentRegistration, error) {
	ctx, cancel := context.WithTimeout(parent, storeTimeout)
	defer cancel()
	list, err := s.cs.CoordinationV1().Leases(s.ns).List(ctx, metav1.ListOptions{LabelSelector: kubeAgentLabel + "=true"})
	if err != nil {
		return nil, kubeErr(err)
	}
	out := []api.AgentRegistration{}
	now := time.Now()
	for _, l := range list.Items {
		if end, ok := leaseEnd(&l); !ok || now.After(end) {
			continue
		}
		applied, _ := strconv.ParseUint(l.Annotations[kubeAppliedAnn], 10, 64)
		out = append(out, api.AgentRegistration{Host: l.Annotations[kubeHostAnn], Addr: l.Annotations[kubeAddrAnn],
			Applied: applied, Seen: l.Spec.RenewTime.UTC(), Version: l.Annotations[kubeVersionAnn]})
	}
	return out, nil
}

// Close implements Store.
func (s *kubeStore) Close() error {
	s.cancel()
	s.wg.Wait()
	return nil
}
