// Package policyserver is Dysco's management plane (paper §2.2, "Role of the
// policy server"): it keeps policies and middlebox types in a bbolt database,
// serves them over HTTPS/JSON to clients with certificates (auth.go), and
// hands each agent the policies meant for it through a long poll
// (/v1/watch). The agent's side of that poll, and of
// the operations the server relays, is internal/psclient.
//
// Every change bumps a version number kept in the database, so that agents
// (which cache the last set they got and keep working while the server is
// down) can tell a newer set from the one they hold.
package policyserver

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/certs"
	"github.com/dysco/dysco/internal/psclient"
)

// Defaults of Config and of the watch route.
const (
	DefaultListen = "0.0.0.0:7017"
	DefaultDB     = "/var/lib/dysco/policy.db"
	// DefaultMetricsListen is the metrics listener's address: loopback.
	DefaultMetricsListen = "127.0.0.1:7018"
	// DefaultWait is how long a watch waits for a change when the request
	// does not say; MaxWait is the most it may ask for.
	DefaultWait = psclient.DefaultWait
	MaxWait     = psclient.MaxWait
)

// maxRequestBody bounds the JSON body of a PUT.
const maxRequestBody = 1 << 20

// Config configures a policy server.
type Config struct {
	// Listen is the TCP address to serve on (DefaultListen when empty).
	Listen string
	// CertFile and KeyFile are the server's certificate and key, and
	// ClientCAFile the CA that signs the clients' certificates
	// (internal/certs); all three are needed unless Insecure.
	CertFile, KeyFile, ClientCAFile string
	// CRLFile is the CA's revocation list (`dysco certs revoke`; empty:
	// crl.pem beside ClientCAFile). A client certificate it lists is
	// refused; the file is read again when it changes, and one that does
	// not exist revokes nothing.
	CRLFile string
	// Insecure serves plain HTTP with no authentication: anyone who reaches
	// the server may do anything, and agents name themselves (host=).
	Insecure bool
	// MetricsListen, when set, serves /metrics and /healthz over plain HTTP
	// on this address (the API listener does not serve /metrics).
	MetricsListen string
	// DB is the bbolt database file (DefaultDB when empty); its directory is
	// created if needed. Unused with Etcd.
	DB string
	// Kubernetes, when set, keeps the policy set in custom resources
	// (kubestore.go) through the API server of Kubeconfig (a kubeconfig
	// file; empty: the pod's own service account), with the replicas'
	// shared objects in KubeNamespace.
	Kubernetes    bool
	Kubeconfig    string
	KubeNamespace string
	// KubeLease is the controller's leader lease (15 s when zero): a
	// controller that dies is replaced within it.
	KubeLease time.Duration
	// ExpiredAgentKeep is how long the Kubernetes store keeps an agent's
	// Lease after it expired (an hour when zero): the controller then
	// deletes it, so that the Leases of nodes gone do not pile up.
	ExpiredAgentKeep time.Duration
	// AgentTTL is how long an agent stays registered without a word from
	// it (registrationTTL when zero): a waiting poll renews the
	// registration every third of it, so it may be shorter than a poll.
	AgentTTL time.Duration
	// Etcd, when set, are the client URLs of an etcd cluster that keeps the
	// policy set instead of DB (etcdstore.go): the server is then one of
	// any number of stateless replicas. EtcdPrefix is where in etcd
	// (DefaultEtcdPrefix when empty); EtcdCertFile, EtcdKeyFile and
	// EtcdCAFile, when set, are the client certificate, its key and the CA
	// of etcd's server certificate (https:// URLs).
	Etcd                                  []string
	EtcdPrefix                            string
	EtcdCertFile, EtcdKeyFile, EtcdCAFile string
	// ReadyFile, when set, is written with the listening address once the
	// server accepts connections, and removed when it stops.
	ReadyFile string
	// ValidatePolicy is the hook that checks a policy beyond
	// api.Policy.Validate, which always runs first: the CLI sets it to
	// compile the tcpdump filter with libpcap. Nil: Validate alone.
	ValidatePolicy func(api.Policy) error
	// ValidateMatch checks the match filter of an operation (the CLI sets
	// it to compile the filter with libpcap). Nil: no check here; the
	// agent checks it anyway.
	ValidateMatch func(string) error
	// Logger receives structured logs (slog.Default() when nil).
	Logger *slog.Logger
}

// Server serves the policy database. Create it with New, serve it with
// Serve (or mount Handler), and Close it.
type Server struct {
	cfg Config
	log *slog.Logger
	st  Store
	mux *http.ServeMux

	// tls is the listener's TLS configuration and roots the CA pool client
	// certificates are verified against; both nil when insecure.
	tls   *tls.Config
	roots *x509.CertPool
	// revoked is the CA's revocation list (nil when insecure).
	revoked *certs.Revocations
	// reg holds the metrics; refused counts the requests answered 401 or 403.
	reg     *prometheus.Registry
	refused *prometheus.CounterVec
	// handshakeErrors counts the TLS handshakes that failed.
	handshakeErrors prometheus.Counter

	// wmu serializes writes so that the published sets follow versions.
	wmu sync.Mutex

	// mu guards cur and changed. changed is closed (and replaced) whenever
	// cur changes: a broadcast to every waiting watch.
	mu      sync.Mutex
	cur     api.PolicySet
	changed chan struct{}

	closing   chan struct{} // closed when the server stops, to end long polls
	closeOnce sync.Once
	watchers  atomic.Int64

	// storeChanged is signalled by a store that sees the set change
	// (etcd); following is closed when followStore has stopped (nil: no
	// such goroutine).
	storeChanged chan struct{}
	following    chan struct{}

	// ops are the operations relayed to agents (operations.go).
	ops opStore

	// waitHook, when set (by tests), runs each time a watch starts waiting.
	waitHook func()
}

// New opens the database named by cfg.DB and returns a server over it.
func New(cfg Config) (*Server, error) {
	if cfg.Listen == "" {
		cfg.Listen = DefaultListen
	}
	if cfg.DB == "" {
		cfg.DB = DefaultDB
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.AgentTTL != 0 && (cfg.AgentTTL < MinAgentTTL || cfg.AgentTTL > time.Hour) {
		return nil, fmt.Errorf("policy server: agent TTL %v: want %v to 1h", cfg.AgentTTL, MinAgentTTL)
	}
	var (
		tc      *tls.Config
		roots   *x509.CertPool
		revoked *certs.Revocations
	)
	if !cfg.Insecure {
		if cfg.CertFile == "" || cfg.KeyFile == "" || cfg.ClientCAFile == "" {
			return nil, errors.New("policy server: TLS needs the server's certificate and key and the clients' CA (--tls-cert, --tls-key, --client-ca), or --insecure for plain HTTP without authentication")
		}
		var err error
		tc, roots, err = certs.ServerTLS(cfg.CertFile, cfg.KeyFile, cfg.ClientCAFile)
		if err != nil {
			return nil, fmt.Errorf("policy server: %w; create the certificates with `dysco certs` (docs/operating.md, \"Policy server\"), or pass --insecure to serve plain HTTP with no authentication", err)
		}
		crl := cfg.CRLFile
		if crl == "" {
			crl = filepath.Join(filepath.Dir(cfg.ClientCAFile), certs.CRLFile)
		}
		if revoked, err = certs.LoadRevocations(crl, cfg.ClientCAFile); err != nil {
			return nil, fmt.Errorf("policy server: %w (`dysco certs revoke` writes it, signed by the CA)", err)
		}
		revoked.Failed = func(err error) {
			cfg.Logger.Warn("the revocation list changed but cannot be read; the last one read stays in force", "err", err)
		}
	}
	s := &Server{
		cfg:          cfg,
		log:          cfg.Logger,
		changed:      make(chan struct{}),
		closing:      make(chan struct{}),
		storeChanged: make(chan struct{}, 1),
		ops:          newMemOps(),
		tls:          tc,
		roots:        roots,
		revoked:      revoked,
	}
	if cfg.Kubernetes && len(cfg.Etcd) > 0 {
		return nil, errors.New("policy server: give --etcd or --kubernetes, not both")
	}
	if cfg.Kubernetes {
		if err := s.openKube(cfg); err != nil {
			return nil, err
		}
	} else if len(cfg.Etcd) > 0 {
		ec, err := etcdClientConfig(cfg)
		if err != nil {
			return nil, err
		}
		// Changes by any replica reach this one through the store's
		// watch: it publishes them (followStore).
		st, err := openEtcdStore(ec, cfg.EtcdPrefix, cfg.Logger, func() {
			select {
			case s.storeChanged <- struct{}{}:
			default:
			}
		}, s.loadSet)
		if err != nil {
			return nil, err
		}
		s.st = st
		// Operations too, so that any replica serves each step of one.
		s.ops = newEtcdOps(st, s.agentTTL())
		// A replica that loses its quorum ends the agents' waiting polls
		// (they are answered 503 and ask another replica).
		st.startProbe(s.wake)
		s.following = make(chan struct{})
		go s.followStore()
	} else {
		st, err := openStore(cfg.DB)
		if err != nil {
			return nil, err
		}
		if err := guard(func() (err error) { s.cur, err = st.load(); return err }); err != nil {
			st.Close()
			return nil, &DamagedError{Path: cfg.DB, Err: err}
		}
		if err := st.backup(BackupPath(cfg.DB)); err != nil {
			cfg.Logger.Warn("no copy of the sound database made", "err", err)
		}
		s.st = st
	}
	s.initMetrics()
	s.routes()
	return s, nil
}

// followStore publishes the changes the store reports (other replicas'
// among them) until the server closes.
func (s *Server) followStore() {
	defer close(s.following)
	for {
		select {
		case <-s.closing:
			return
		case <-s.storeChanged:
			// Not under wmu: a read that waits for a lost quorum must
			// not hold up this replica's writes, which fail fast.
			if err := s.publish(); err != nil {
				s.log.Warn("the policy store changed but cannot be read; agents keep the set they have", "err", err)
			}
		}
	}
}

// routes serves each route to the roles that may use it (auth.go).
func (s *Server) routes() {
	s.mux = http.NewServeMux()
	s.guard("GET /healthz", anyRole, s.handleHealthz)
	s.guard("GET /v1/policies", readers, s.handleList)
	s.guard("PUT /v1/policies/{name}", operatorOnly, s.handlePutPolicy)
	s.guard("DELETE /v1/policies/{name}", operatorOnly, s.handleDeletePolicy)
	s.guard("PUT /v1/types/{name}", operatorOnly, s.handlePutType)
	s.guard("DELETE /v1/types/{name}", operatorOnly, s.handleDeleteType)
	s.guard("GET /v1/watch", watchers, s.handleWatch)
	s.guard("GET /v1/agents", readers, s.handleAgents)
	s.guard("POST /v1/operations", operatorOnly, s.handleCreateOp)
	s.guard("GET /v1/operations", readers, s.handleListOps)
	s.guard("GET /v1/operations/{id}", readers, s.handleGetOp)
	s.guard("POST /v1/operations/claim", agentOnly, s.handleClaimOp)
	s.guard("PUT /v1/operations/{id}/result", agentOnly, s.handleReportOp)
	s.guard("/", anyRole, s.handleNoRoute)
}

// MetricsHandler serves /metrics and /healthz, for the metrics listener.
func (s *Server) MetricsHandler() http.Handler {
	m := http.NewServeMux()
	m.Handle("GET /metrics", s.metricsHandler())
	m.HandleFunc("GET /healthz", s.handleHealthz)
	return m
}

// Handler returns the server's HTTP handler.
func (s *Server) Handler() http.Handler { return s.mux }

// Current returns the policy set in force.
func (s *Server) Current() api.PolicySet {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cur
}

// Serve serves on ln until ctx is done, then ends the long polls and shuts
// down gracefully. It returns nil after a shutdown asked by ctx.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	// Connections accepted that have not sent a request yet: an HTTP
	// client with requests in parallel dials spares that it may never
	// use, and http.Server.Shutdown counts such a connection as busy for
	// its first 5 s, which is all the time shutdown has. They carry no
	// request, so shutdown closes them.
	var (
		freshMu sync.Mutex
		fresh   = map[net.Conn]struct{}{}
	)
	hs := &http.Server{
		Handler:           s.mux,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          log.New(handshakeCounter{s}, "", 0),
		ConnContext: func(ctx context.Context, _ net.Conn) context.Context {
			return context.WithValue(ctx, connAuthKey{}, &connAuth{})
		},
		ConnState: func(c net.Conn, st http.ConnState) {
			freshMu.Lock()
			defer freshMu.Unlock()
			if st == http.StateNew {
				fresh[c] = struct{}{}
			} else {
				delete(fresh, c)
			}
		},
	}
	if s.tls != nil {
		ln = tls.NewListener(ln, s.tls)
	}
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("policy server: %w", err)
	case <-ctx.Done():
	}
	s.log.Info("policy server shutting down")
	s.stop()
	freshMu.Lock()
	for c := range fresh {
		c.Close()
	}
	freshMu.Unlock()
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := hs.Shutdown(sctx)
	if serr := <-errc; !errors.Is(serr, http.ErrServerClosed) && err == nil {
		err = serr
	}
	if err != nil {
		return fmt.Errorf("policy server shutdown: %w", err)
	}
	return nil
}

// stop ends the waiting watches (they answer 503) so that shutdown does not
// wait for them.
func (s *Server) stop() { s.closeOnce.Do(func() { close(s.closing) }) }

// Close ends the waiting watches and closes the database.
func (s *Server) Close() error {
	s.stop()
	if s.following != nil {
		<-s.following
	}
	s.ops.close()
	return s.st.Close()
}

// Run serves cfg until ctx is done: the `dysco policy-server` command.
func Run(ctx context.Context, cfg Config) error {
	if cfg.ReadyFile != "" {
		// A file left by an earlier run must not tell anyone we are ready.
		if err := os.Remove(cfg.ReadyFile); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("ready file: %w", err)
		}
	}
	s, err := New(cfg)
	if err != nil {
		return err
	}
	defer s.Close()
	ln, err := net.Listen("tcp", s.cfg.Listen)
	if err != nil {
		return fmt.Errorf("policy server: %w", err)
	}
	scheme := "https"
	if cfg.Insecure {
		scheme = "http"
		if !isLoopback(ln.Addr()) {
			s.log.Warn("INSECURE: serving plain HTTP with no authentication on a non-loopback address: anyone who reaches it can change policies and run operations on the agents", "addr", ln.Addr().String())
		} else {
			s.log.Warn("insecure: serving plain HTTP with no authentication (loopback only)", "addr", ln.Addr().String())
		}
	}
	if cfg.MetricsListen != "" {
		mln, err := net.Listen("tcp", cfg.MetricsListen)
		if err != nil {
			ln.Close()
			return fmt.Errorf("policy server: --metrics-listen: %w", err)
		}
		ms := &http.Server{Handler: s.MetricsHandler(), ReadHeaderTimeout: 10 * time.Second,
			ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelWarn)}
		go ms.Serve(mln)
		defer ms.Close()
		if !isLoopback(mln.Addr()) {
			s.log.Warn("metrics served without authentication on a non-loopback address", "addr", mln.Addr().String())
		}
		s.log.Info("policy server metrics", "addr", mln.Addr().String())
	}
	cur := s.Current()
	store := []any{"db", s.cfg.DB}
	switch {
	case s.cfg.Kubernetes:
		store = []any{"store", "kubernetes"}
	case len(s.cfg.Etcd) > 0:
		store = []any{"store", "etcd", "endpoints", strings.Join(s.cfg.Etcd, ",")}
	}
	s.log.Info("policy server listening", append(append([]any{"addr", ln.Addr().String(), "scheme", scheme}, store...),
		"version", cur.Version, "policies", len(cur.Policies), "types", len(cur.Types))...)
	if cfg.ReadyFile != "" {
		if err := psclient.WriteFileAtomic(cfg.ReadyFile, []byte(ln.Addr().String()+"\n"), 0o644); err != nil {
			ln.Close()
			return fmt.Errorf("ready file: %w", err)
		}
		defer os.Remove(cfg.ReadyFile)
	}
	return s.Serve(ctx, ln)
}

// handshakeCounter is the API server's error log: it counts the failed TLS
// handshakes (plain HTTP to the TLS listener, a client that does not trust
// the server) and passes every line to the server's log.
type handshakeCounter struct{ s *Server }

func (h handshakeCounter) Write(p []byte) (int, error) {
	msg := strings.TrimSpace(string(p))
	if strings.HasPrefix(msg, "http: TLS handshake error") {
		h.s.handshakeErrors.Inc()
	}
	h.s.log.Warn(msg)
	return len(p), nil
}

// isLoopback tells whether a listener's address is a loopback address.
func isLoopback(a net.Addr) bool {
	ta, ok := a.(*net.TCPAddr)
	return ok && ta.IP.IsLoopback()
}

// publish makes the database's current content the set in force and wakes
// every watch.
func (s *Server) publish() error {
	set, err := s.st.Load(context.Background())
	if err != nil {
		return err
	}
	s.mu.Lock()
	if set.Version <= s.cur.Version {
		// Seen already (a replica publishes its own change, then
		// hears of it from the store), or an older read that lost
		// the race with a newer one: sets are published in version
		// order.
		s.mu.Unlock()
		return nil
	}
	s.cur = set
	close(s.changed)
	s.changed = make(chan struct{})
	s.mu.Unlock()
	return nil
}

// ForHost returns the part of set that the policy server gives the agent
// host: the policies whose Hosts is empty or names host, and every type.
func ForHost(set api.PolicySet, host string) api.PolicySet {
	out := api.PolicySet{Version: set.Version, Policies: []api.Policy{}, Types: set.Types}
	for _, p := range set.Policies {
		if len(p.Hosts) == 0 || slices.Contains(p.Hosts, host) {
			out.Policies = append(out.Policies, p)
		}
	}
	if out.Types == nil {
		out.Types = []api.MiddleboxType{}
	}
	return out
}

func (s *Server) handleHealthz(w http.ResponseWriter, r *http.Request) {
	if err := s.quorum(); err != nil {
		// For load balancers: send agents and operators elsewhere.
		writeJSON(w, http.StatusServiceUnavailable, map[string]any{"status": "no quorum", "error": err.Error(), "version": s.Current().Version})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"status": "ok", "version": s.Current().Version})
}

// handleList serves the set in force. A replica whose store has no quorum
// answers 503 instead, as to the agents' polls: the set it holds may be
// behind, and a client given several replicas asks the next.
func (s *Server) handleList(w http.ResponseWriter, r *http.Request) {
	if err := s.quorum(); err != nil {
		writeError(w, http.StatusServiceUnavailable, err)
		return
	}
	writeJSON(w, http.StatusOK, s.Current())
}

func (s *Server) handlePutPolicy(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	var p api.Policy
	if err := decodeBody(r, w, &p, "policy"); err != nil {
		writeError(w, http.StatusBadRequest, err)
		return
	}
	if p.Name == "" {
		p.Name = name
	}
	if p.Name != name {
		writeError(w, http.StatusBadRequest, fmt.Errorf("policy name in the path (%q) differs from the name in the body (%q)", name, p.Name))
		return
	}
	if err := s.validatePolicy(p); err != nil {
		writeError(w, http.StatusBadRequest, err)
		return
	}
	s.write(w, r, "policy", name, func() (bool, error) { return s.st.PutPolicy(r.Context(), p) }, p)
}

func (s *Server) validatePolicy(p api.Policy) error {
	if err := p.Validate(); err != nil {
		return err
	}
	if s.cfg.ValidatePolicy != nil {
		return s.cfg.ValidatePolicy(p)
	}
	return nil
}

func (s *Server) handlePutType(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	var t api.MiddleboxType
	if err := decodeBody(r, w, &t, "middlebox type"); err != nil {
		writeError(w, http.StatusBadRequest, err)
		return
	}
	if t.Name == "" {
		t.Name = name
	}
	if t.Name != name {
		writeError(w, http.StatusBadRequest, fmt.Errorf("type name in the path (%q) differs from the name in the body (%q)", name, t.Name))
		return
	}
	if err := t.Validate(); err != nil {
		writeError(w, http.StatusBadRequest, err)
		return
	}
	s.write(w, r, "type", name, func() (bool, error) { return s.st.PutType(r.Context(), t) }, t)
}

func (s *Server) handleDeletePolicy(w http.ResponseWriter, r *http.Request) {
	s.remove(w, r, "policy", s.st.DeletePolicy)
}

func (s *Server) handleDeleteType(w http.ResponseWriter, r *http.Request) {
	s.remove(w, r, "type", s.st.DeleteType)
}

// write runs a change and publishes the result; it answers with stored.
func (s *Server) write(w http.ResponseWriter, r *http.Request, kind, name string, change func() (bool, error), stored any) {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	changed, err := change()
	if err == nil && changed {
		err = s.publish()
	}
	var full *FullError
	var nq *NoQuorumError
	var unpub *UnpublishedError
	switch {
	case errors.As(err, &full):
		writeError(w, http.StatusConflict, err)
		return
	case errors.As(err, &nq):
		s.log.Warn("storing "+kind+" failed", kind, name, "err", err)
		writeError(w, http.StatusServiceUnavailable, err)
		return
	case errors.As(err, &unpub):
		s.log.Warn(kind+" stored but not published", kind, name, "err", err)
		writeError(w, unpub.status(), err)
		return
	}
	if err != nil {
		s.log.Error("storing "+kind+" failed", kind, name, "err", err)
		writeError(w, http.StatusInternalServerError, err)
		return
	}
	if changed {
		s.log.Info(kind+" stored", kind, name, "version", s.Current().Version, "remote", r.RemoteAddr)
	}
	writeJSON(w, http.StatusOK, stored)
}

func (s *Server) remove(w http.ResponseWriter, r *http.Request, kind string, del func(context.Context, string) (bool, error)) {
	name := r.PathValue("name")
	s.wmu.Lock()
	defer s.wmu.Unlock()
	found, err := del(r.Context(), name)
	if err == nil && found {
		err = s.publish()
	}
	var inUse *api.TypeInUseError
	var nq *NoQuorumError
	var unpub *UnpublishedError
	switch {
	case errors.As(err, &inUse):
		writeError(w, http.StatusConflict, err)
		return
	case errors.As(err, &unpub):
		s.log.Warn(kind+" deleted but the set without it is not published", kind, name, "err", err)
		writeError(w, unpub.status(), err)
		return
	case errors.As(err, &nq):
		s.log.Warn("deleting "+kind+" failed", kind, name, "err", err)
		writeError(w, http.StatusServiceUnavailable, err)
		return
	}
	if err != nil {
		s.log.Error("deleting "+kind+" failed", kind, name, "err", err)
		writeError(w, http.StatusInternalServerError, err)
		return
	}
	if !found {
		writeError(w, http.StatusNotFound, fmt.Errorf("%s %q not found", kind, name))
		return
	}
	s.log.Info(kind+" deleted", kind, name, "version", s.Current().Version, "remote", r.RemoteAddr)
	w.WriteHeader(http.StatusNoContent)
}

// handleWatch is the long poll of the agents: it answers at once with the
// host's set when the version is above after, else when the set changes or
// the wait is over (with the set unchanged; the agent compares versions).
func (s *Server) handleWatch(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	host, ok := s.agentHost(w, r, "watch")
	if !ok {
		return
	}
	var after uint64
	if v := q.Get("after"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			writeError(w, http.StatusBadRequest, fmt.Errorf("watch: after=%q is not a version number", v))
			return
		}
		after = n
	}
	wait := DefaultWait
	if v := q.Get("wait"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			writeError(w, http.StatusBadRequest, fmt.Errorf("watch: wait=%q is not a number of seconds", v))
			return
		}
		wait = waitSeconds(n)
	}

	version := q.Get("version")
	if len(version) > maxVersionLen || strings.IndexFunc(version, func(r rune) bool { return r < ' ' || r > '~' }) >= 0 {
		writeError(w, http.StatusBadRequest, fmt.Errorf("watch: version=%.40q is not a version (at most %d printable ASCII characters)", version, maxVersionLen))
		return
	}
	s.register(host, r.RemoteAddr, after, version)
	s.watchers.Add(1)
	defer s.watchers.Add(-1)
	timer := time.NewTimer(wait)
	defer timer.Stop()
	// The registration lives while the poll waits: an agent that dies
	// ends its connection, and lapses one TTL later.
	renew := time.NewTicker(max(s.agentTTL()/3, 100*time.Millisecond))
	defer renew.Stop()
	for {
		// Take the channel with the set: a change after this point closes it.
		s.mu.Lock()
		set, changed := s.cur, s.changed
		s.mu.Unlock()
		if err := s.quorum(); err != nil {
			// The set this replica holds may be behind: the agent
			// keeps its own, and asks another replica (api.Client
			// moves on at a 503). A replica losing its quorum wakes
			// the waiting polls.
			writeError(w, http.StatusServiceUnavailable, err)
			return
		}
		if set.Version > after {
			writeJSON(w, http.StatusOK, ForHost(set, host))
			return
		}
		if s.waitHook != nil {
			s.waitHook()
		}
		select {
		case <-changed:
		case <-renew.C:
			s.register(host, r.RemoteAddr, after, version)
		case <-timer.C:
			writeJSON(w, http.StatusOK, ForHost(set, host))
			return
		case <-r.Context().Done():
			return
		case <-s.closing:
			writeError(w, http.StatusServiceUnavailable, errors.New("policy server is shutting down"))
			return
		}
	}
}

// loadSet puts in force a set its store read (at start, or late when the
// store could not be read at start), if it is newer than the one in
// force. A store calls it before it says it is healthy.
func (s *Server) loadSet(set api.PolicySet) {
	s.mu.Lock()
	if set.Version > s.cur.Version {
		s.cur = set
	}
	s.mu.Unlock()
}

// wake makes every waiting watch look again (at the set and the quorum).
func (s *Server) wake() {
	s.mu.Lock()
	close(s.changed)
	s.changed = make(chan struct{})
	s.mu.Unlock()
}

// quorumChecker is a store that can tell whether it has a quorum now, and
// say so (why adds to the reason).
type quorumChecker interface {
	Healthy() bool
	noQuorum(why string) error
}

// quorum is a *NoQuorumError when the store says it has no quorum now.
func (s *Server) quorum() error {
	if q, ok := s.st.(quorumChecker); ok && !q.Healthy() {
		return q.noQuorum("so its policies may be behind")
	}
	return nil
}

// maxVersionLen bounds the version an agent's poll gives.
const maxVersionLen = 64

// registrationTTL is how long an agent stays registered without a word
// from it, by default: the longest poll, and time to send the next.
var registrationTTL = MaxWait + 15*time.Second

// MinAgentTTL is the shortest Config.AgentTTL: etcd grants no shorter lease
// (with its default election timeout).
const MinAgentTTL = 2 * time.Second

// agentTTL is how long an agent stays registered without a word from it.
func (s *Server) agentTTL() time.Duration {
	if s.cfg.AgentTTL > 0 {
		return s.cfg.AgentTTL
	}
	return registrationTTL
}

// register records the agent's poll in the store, in the background: a
// store without a quorum must not hold up the poll, which the replica
// answers from the set it holds.
func (s *Server) register(host, remote string, applied uint64, version string) {
	addr := remote
	if h, _, err := net.SplitHostPort(remote); err == nil {
		addr = h
	}
	reg := api.AgentRegistration{Host: host, Addr: addr, Applied: applied, Seen: time.Now().UTC(), Version: version}
	go func() {
		if err := s.st.Register(context.Background(), reg, s.agentTTL()); err != nil {
			s.log.Debug("cannot register the agent", "host", host, "err", err)
		}
	}()
}

// handleAgents lists the agents registered (any replica's, with etcd).
func (s *Server) handleAgents(w http.ResponseWriter, r *http.Request) {
	regs, err := s.st.Agents(r.Context())
	var nq *NoQuorumError
	switch {
	case errors.As(err, &nq):
		writeError(w, http.StatusServiceUnavailable, err)
		return
	case err != nil:
		writeError(w, http.StatusInternalServerError, err)
		return
	}
	writeJSON(w, http.StatusOK, regs)
}

// handleNoRoute answers, in JSON, requests that match no route: 405 when the
// path exists with other methods, else 404.
func (s *Server) handleNoRoute(w http.ResponseWriter, r *http.Request) {
	var allowed []string
	for _, m := range []string{http.MethodGet, http.MethodPut, http.MethodDelete, http.MethodPost} {
		if m == r.Method {
			continue
		}
		r2 := r.Clone(r.Context())
		r2.Method = m
		if _, pat := s.mux.Handler(r2); pat != "" && pat != "/" {
			allowed = append(allowed, m)
		}
	}
	if len(allowed) > 0 {
		w.Header().Set("Allow", strings.Join(allowed, ", "))
		writeError(w, http.StatusMethodNotAllowed, fmt.Errorf("method %s is not allowed on %s (allowed: %s)", r.Method, r.URL.Path, strings.Join(allowed, ", ")))
		return
	}
	writeError(w, http.StatusNotFound, fmt.Errorf("no route %s %s (routes: /v1/policies[/NAME], /v1/types/NAME, /v1/watch, /v1/operations[/ID[/result]], /v1/operations/claim, /healthz; /metrics is on the metrics listener)", r.Method, r.URL.Path))
}

// decodeBody reads one JSON value into v, refusing unknown fields so that a
// misspelt field is an error rather than silently ignored.
func decodeBody(r *http.Request, w http.ResponseWriter, v any, what string) error {
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxRequestBody))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		if errors.Is(err, io.EOF) {
			return fmt.Errorf("empty request body: send the %s as JSON", what)
		}
		return fmt.Errorf("request body is not a valid %s: %v", what, err)
	}
	if dec.More() {
		return fmt.Errorf("request body holds more than one JSON value; send one %s", what)
	}
	return nil
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(v)
}

func writeError(w http.ResponseWriter, code int, err error) {
	writeJSON(w, code, api.Error{Error: err.Error()})
}
