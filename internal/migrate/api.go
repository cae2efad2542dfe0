package migrate

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/dysco/dysco/internal/api"
)

// The "api" plug-in: middleboxes that keep their own per-session state
// (counters, caches, NAT tables of their own) expose it to the agent as
// "state providers". A provider registers its Unix socket with the agent's
// local API (Providers.Handler); at migration the plug-in asks every
// registered provider for the session's state over HTTP on that socket.
// docs/state-migration-plugins.md specifies the protocol for middlebox
// developers.

// ProviderSession is the session as the provider protocol names it.
type ProviderSession struct {
	Src   netip.Addr `json:"src"`
	Dst   netip.Addr `json:"dst"`
	Sport uint16     `json:"sport"`
	Dport uint16     `json:"dport"`
	Proto uint8      `json:"proto"`
}

// ProviderSessionOf returns s as the provider protocol names it.
func ProviderSessionOf(s Session) ProviderSession {
	t := s.Tuple
	return ProviderSession{Src: t.Src.Unmap(), Dst: t.Dst.Unmap(), Sport: t.SrcPort, Dport: t.DstPort, Proto: s.Proto}
}

// ProviderRequest is the body of POST /v1/export, /v1/import and
// /v1/release to a provider; State (base64 in JSON) only in imports.
type ProviderRequest struct {
	Session ProviderSession `json:"session"`
	State   []byte          `json:"state,omitempty"`
}

// RegisterRequest is the body of PUT /v1/state/providers/{name}.
type RegisterRequest struct {
	// Socket is the provider's Unix socket: a path, or "@name" for an
	// abstract socket (which belongs to the network namespace).
	Socket string `json:"socket"`
}

// ProviderInfo is one registered provider, as GET /v1/state/providers
// lists them.
type ProviderInfo struct {
	Name   string `json:"name"`
	Socket string `json:"socket"`
}

// Providers is the agent's registry of state providers. It is safe for
// concurrent use; the zero value is an empty registry.
type Providers struct {
	mu sync.Mutex
	m  map[string]string // name -> socket
}

// NewProviders returns an empty registry.
func NewProviders() *Providers { return &Providers{m: map[string]string{}} }

var providerName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)

// Register adds or replaces provider name on socket.
func (p *Providers) Register(name, socket string) error {
	if !providerName.MatchString(name) {
		return fmt.Errorf("provider name %q: want 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit", name)
	}
	if err := checkSocket(socket); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.m == nil {
		p.m = map[string]string{}
	}
	p.m[name] = socket
	return nil
}

func checkSocket(s string) error {
	switch {
	case s == "":
		return errors.New(`missing "socket": the provider's Unix socket, a path or "@name" (abstract)`)
	case strings.ContainsRune(s, 0):
		return errors.New("socket name contains a NUL byte")
	case len(s) > 107:
		return fmt.Errorf("socket %q: longer than 107 bytes, the limit of a Unix socket address", s)
	case s[0] != '@' && s[0] != '/':
		return fmt.Errorf("socket %q: want an absolute path or \"@name\" (abstract socket)", s)
	case s == "@":
		return errors.New(`socket "@": abstract socket without a name`)
	}
	return nil
}

// Unregister removes provider name; it tells whether there was one.
func (p *Providers) Unregister(name string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, ok := p.m[name]
	delete(p.m, name)
	return ok
}

// List returns the registered providers, by name.
func (p *Providers) List() []ProviderInfo {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]ProviderInfo, 0, len(p.m))
	for n, s := range p.m {
		out = append(out, ProviderInfo{Name: n, Socket: s})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

func (p *Providers) socket(name string) (string, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	s, ok := p.m[name]
	return s, ok
}

// Handler serves the registry under the agent's local API, which mounts it
// at /v1/state/ (paths arrive whole):
//
//	GET    /v1/state/providers         list (JSON array of ProviderInfo)
//	PUT    /v1/state/providers/{name}  register, body {"socket": "..."}
//	DELETE /v1/state/providers/{name}  unregister (404 when unknown)
//
// Bad input gets 400 and {"error": "..."}.
func (p *Providers) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/state/providers", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, p.List())
	})
	mux.HandleFunc("PUT /v1/state/providers/{name}", func(w http.ResponseWriter, r *http.Request) {
		var req RegisterRequest
		dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, 4096))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&req); err != nil {
			writeErr(w, http.StatusBadRequest, fmt.Errorf(`body: want {"socket": "/path/or/@name"}: %w`, err))
			return
		}
		name := r.PathValue("name")
		if err := p.Register(name, req.Socket); err != nil {
			writeErr(w, http.StatusBadRequest, err)
			return
		}
		writeJSON(w, http.StatusOK, ProviderInfo{Name: name, Socket: req.Socket})
	})
	mux.HandleFunc("DELETE /v1/state/providers/{name}", func(w http.ResponseWriter, r *http.Request) {
		name := r.PathValue("name")
		if !p.Unregister(name) {
			writeErr(w, http.StatusNotFound, fmt.Errorf("no state provider %q", name))
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeErr(w, http.StatusNotFound, fmt.Errorf("%s %s: no such route (GET /v1/state/providers, PUT or DELETE /v1/state/providers/NAME)", r.Method, r.URL.Path))
	})
	return mux
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

func writeErr(w http.ResponseWriter, code int, err error) {
	writeJSON(w, code, api.Error{Error: err.Error()})
}

// API is the "api" plug-in: it asks every registered provider for its state
// of the session. Its state is the JSON object provider name -> that
// provider's state.
type API struct {
	providers *Providers
}

// NewAPI returns the "api" plug-in over the registry p.
func NewAPI(p *Providers) *API { return &API{providers: p} }

// Name returns "api".
func (*API) Name() string { return NameAPI }

// defaultProviderTimeout bounds a call to a provider when ctx has no
// deadline.
const defaultProviderTimeout = 10 * time.Second

// call POSTs req to path on provider name's socket and returns the status
// and body of a 2xx answer.
func (a *API) call(ctx context.Context, name, socket, path string, req ProviderRequest) (int, []byte, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, defaultProviderTimeout)
		defer cancel()
	}
	body, err := json.Marshal(req)
	if err != nil {
		return 0, nil, err
	}
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", socket)
	}}
	defer tr.CloseIdleConnections()
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+name+path, bytes.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	hreq.Header.Set("Content-Type", "application/json")
	resp, err := (&http.Client{Transport: tr}).Do(hreq)
	if err != nil {
		return 0, nil, fmt.Errorf("provider %q on %s: %w", name, socket, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, MaxBundleSize+1))
	if err != nil {
		return 0, nil, fmt.Errorf("provider %q: POST %s: reading answer: %w", name, path, err)
	}
	if len(data) > MaxBundleSize {
		return 0, nil, fmt.Errorf("provider %q: POST %s: answer longer than %d bytes", name, path, MaxBundleSize)
	}
	if resp.StatusCode/100 != 2 {
		msg := strings.TrimSpace(string(data))
		var e api.Error
		if json.Unmarshal(data, &e) == nil && e.Error != "" {
			msg = e.Error
		}
		if len(msg) > 300 {
			msg = msg[:300] + "..."
		}
		return 0, nil, fmt.Errorf("provider %q: POST %s: %s: %s", name, path, resp.Status, msg)
	}
	return resp.StatusCode, data, nil
}

// Export asks every provider (by name) for its state of s: 200 with the
// state, 204 when it has none. Nil when no provider has state.
func (a *API) Export(ctx context.Context, s Session) ([]byte, error) {
	states := map[string][]byte{}
	for _, p := range a.providers.List() {
		code, data, err := a.call(ctx, p.Name, p.Socket, "/v1/export", ProviderRequest{Session: ProviderSessionOf(s)})
		if err != nil {
			return nil, err
		}
		if code == http.StatusNoContent {
			continue
		}
		if data == nil {
			data = []byte{}
		}
		states[p.Name] = data
	}
	if len(states) == 0 {
		return nil, nil
	}
	return json.Marshal(states)
}

// Import hands each provider its state. Every provider named must be
// registered here (checked first); when one fails, the providers already
// imported are asked to release the session again.
func (a *API) Import(ctx context.Context, s Session, state []byte) error {
	var states map[string][]byte
	if err := json.Unmarshal(state, &states); err != nil {
		return fmt.Errorf("decoding state: %w", err)
	}
	names := sortedKeys(states)
	sockets := map[string]string{}
	for _, n := range names {
		sock, ok := a.providers.socket(n)
		if !ok {
			return fmt.Errorf("state for provider %q, which is not registered on this host (registered: %s)", n, a.registered())
		}
		sockets[n] = sock
	}
	ps := ProviderSessionOf(s)
	for i, n := range names {
		if _, _, err := a.call(ctx, n, sockets[n], "/v1/import", ProviderRequest{Session: ps, State: states[n]}); err != nil {
			for _, m := range names[:i] {
				if _, _, rerr := a.call(ctx, m, sockets[m], "/v1/release", ProviderRequest{Session: ps}); rerr != nil {
					err = errors.Join(err, fmt.Errorf("rolling back: %w", rerr))
				}
			}
			return err
		}
	}
	return nil
}

func (a *API) registered() string {
	var ns []string
	for _, p := range a.providers.List() {
		ns = append(ns, p.Name)
	}
	if len(ns) == 0 {
		return "none"
	}
	return strings.Join(ns, ", ")
}

// Release asks every registered provider to drop the session; it tries them
// all and returns their errors together.
func (a *API) Release(ctx context.Context, s Session) error {
	var errs []error
	for _, p := range a.providers.List() {
		if _, _, err := a.call(ctx, p.Name, p.Socket, "/v1/release", ProviderRequest{Session: ProviderSessionOf(s)}); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
