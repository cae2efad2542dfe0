package api

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
)

// ErrNoAgent is the error a client of the local agent returns when nothing
// listens on the agent's socket in the caller's network namespace.
var ErrNoAgent = errors.New(`no dysco agent in this network namespace (is "dysco agent" running? run the CLI inside the host's namespace: ip netns exec NAME dysco ...)`)

// DefaultTimeout bounds each request of a Client whose context has no
// deadline of its own (long polls excepted).
const DefaultTimeout = 10 * time.Second

// maxBody bounds the answers a Client reads.
const maxBody = 16 << 20

// Client talks HTTP/JSON to the local agent (over its abstract Unix socket)
// or to the policy server (over TCP). Both serve the /v1/policies and
// /v1/types routes; /v1/status and /v1/sessions exist on the agent only and
// /v1/watch on the policy server only. A Client is safe for concurrent use.
type Client struct {
	// peers are "http://dysco-agent", or the policy server's URLs (several
	// replicas: tried in turn), without a trailing slash.
	peers []peer
	cur   atomic.Int32 // the peer that answered last
	hc    *http.Client
	// Timeout bounds each request whose context has no deadline; zero means
	// DefaultTimeout. Watch is bounded by its wait instead, and the
	// reconfiguration requests (Reconfig, Middlebox, Splice with Wait) by
	// the agent's own wait plus ReconfigSlack when that is longer.
	Timeout time.Duration
}

// peer is one server a Client may talk to.
type peer struct {
	base   string // URL without a trailing slash
	target string // what error messages call it
}

// NewAgentClient returns a client of the agent of the caller's network
// namespace, on AgentSocket.
func NewAgentClient() *Client { return NewUnixClient(AgentSocket) }

// NewUnixClient returns a client of an agent serving on the Unix socket
// socket ("@name" for an abstract socket, as AgentSocket).
func NewUnixClient(socket string) *Client {
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			c, err := d.DialContext(ctx, "unix", socket)
			if err != nil {
				return nil, &noAgentError{cause: err}
			}
			// Anyone may bind the socket's name before the agent:
			// send nothing to a server of another user.
			if err := CheckAgentPeer(c, socket); err != nil {
				c.Close()
				return nil, err
			}
			return c, nil
		},
		MaxIdleConns:    2,
		IdleConnTimeout: 30 * time.Second,
	}
	return &Client{
		peers: []peer{{base: "http://dysco-agent", target: "agent on " + socket}},
		hc:    &http.Client{Transport: tr},
	}
}

// NewServerClient returns a client of the policy server at serverURL
// ("http://host:7017"; a bare "host:port" means http), without TLS
// certificates of its own: for a server started with --insecure.
func NewServerClient(serverURL string) *Client { return NewServerClientTLS(serverURL, nil) }

// NewServerClientTLS returns a client of the policy server at serverURL
// ("https://host:7017"; a bare "host:port" means https when tc is set)
// that presents tc's client certificate and verifies the server against
// tc's CA. An http:// URL is served without TLS. serverURL may list
// several replicas, separated by commas: a request that finds one
// unreachable, or answered 503 (shutting down, or without a quorum), is
// sent to the next, and the one that answers is asked first next time.
func NewServerClientTLS(serverURL string, tc *tls.Config) *Client {
	var peers []peer
	for _, one := range strings.Split(serverURL, ",") {
		u := strings.TrimRight(strings.TrimSpace(one), "/")
		if u == "" && len(peers) > 0 {
			continue
		}
		if !strings.Contains(u, "://") {
			if tc != nil {
				u = "https://" + u
			} else {
				u = "http://" + u
			}
		}
		peers = append(peers, peer{base: u, target: "policy server " + u})
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	if tc != nil {
		tr.TLSClientConfig = tc.Clone()
		tr.ForceAttemptHTTP2 = false
	}
	return &Client{peers: peers, hc: &http.Client{Transport: tr}}
}

// Target describes the peer, for messages: "agent on @dysco-agent" or
// "policy server http://10.0.0.9:7017" (the replica asked first).
func (c *Client) Target() string { return c.peers[int(c.cur.Load())%len(c.peers)].target }

// HTTPError is the error for an answer whose status is not 2xx; Message is
// the api.Error the peer sent.
type HTTPError struct {
	StatusCode int
	Message    string
}

func (e *HTTPError) Error() string { return e.Message }

// IsNotFound tells whether err is a 404 answer (for example deleting a policy
// that does not exist).
func IsNotFound(err error) bool {
	var he *HTTPError
	return errors.As(err, &he) && he.StatusCode == http.StatusNotFound
}

// Status returns the agent's status.
func (c *Client) Status(ctx context.Context) (Status, error) {
	var s Status
	err := c.do(ctx, http.MethodGet, "/v1/status", nil, &s)
	return s, err
}

// Sessions returns the sessions the agent knows.
func (c *Client) Sessions(ctx context.Context) ([]Session, error) {
	var s []Session
	err := c.do(ctx, http.MethodGet, "/v1/sessions", nil, &s)
	return s, err
}

// Policies returns every policy and middlebox type the peer holds.
func (c *Client) Policies(ctx context.Context) (PolicySet, error) {
	var s PolicySet
	err := c.do(ctx, http.MethodGet, "/v1/policies", nil, &s)
	return s, err
}

// Agents returns the agents registered at a policy server.
func (c *Client) Agents(ctx context.Context) ([]AgentRegistration, error) {
	var out []AgentRegistration
	err := c.do(ctx, http.MethodGet, "/v1/agents", nil, &out)
	return out, err
}

// PutPolicy creates or replaces the policy p.Name.
func (c *Client) PutPolicy(ctx context.Context, p Policy) error {
	if p.Name == "" {
		return errors.New("policy has no name")
	}
	return c.do(ctx, http.MethodPut, "/v1/policies/"+url.PathEscape(p.Name), p, nil)
}

// DeletePolicy removes the policy name; IsNotFound(err) when there is none.
func (c *Client) DeletePolicy(ctx context.Context, name string) error {
	return c.do(ctx, http.MethodDelete, "/v1/policies/"+url.PathEscape(name), nil, nil)
}

// PutType creates or replaces the middlebox type t.Name.
func (c *Client) PutType(ctx context.Context, t MiddleboxType) error {
	if t.Name == "" {
		return errors.New("middlebox type has no name")
	}
	return c.do(ctx, http.MethodPut, "/v1/types/"+url.PathEscape(t.Name), t, nil)
}

// DeleteType removes the middlebox type name; IsNotFound(err) when there is none.
func (c *Client) DeleteType(ctx context.Context, name string) error {
	return c.do(ctx, http.MethodDelete, "/v1/types/"+url.PathEscape(name), nil, nil)
}

// Watch long-polls the policy server for the policy set of host: the server
// answers at once when its version is above after, else when it changes or
// wait has passed (the caller compares versions). version, when not empty,
// is the agent's version for its registration. Policy server only.
func (c *Client) Watch(ctx context.Context, host string, after uint64, wait time.Duration, version string) (PolicySet, error) {
	q := url.Values{}
	q.Set("host", host)
	if version != "" {
		q.Set("version", version)
	}
	q.Set("after", strconv.FormatUint(after, 10))
	q.Set("wait", strconv.Itoa(int(wait/time.Second)))
	// Give the server its whole wait plus time to answer.
	ctx, cancel := context.WithTimeout(ctx, wait+DefaultTimeout)
	defer cancel()
	var s PolicySet
	err := c.do(ctx, http.MethodGet, "/v1/watch?"+q.Encode(), nil, &s)
	return s, err
}

// do sends body (if not nil) as JSON and decodes a 2xx answer into out (if not nil).
func (c *Client) do(ctx context.Context, method, path string, body, out any) error {
	if _, ok := ctx.Deadline(); !ok {
		t := c.Timeout
		if t == 0 {
			t = DefaultTimeout
		}
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, t)
		defer cancel()
	}
	var data []byte
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return fmt.Errorf("%s %s: encoding request: %w", method, path, err)
		}
		data = b
	}
	n := len(c.peers)
	first := int(c.cur.Load()) % n
	var err error
	for i := range n {
		k := (first + i) % n
		err = c.doAt(ctx, k, method, path, data, body != nil, out)
		if err == nil || ctx.Err() != nil || !failover(method, err) {
			break
		}
	}
	return err
}

// failover tells whether a request that failed with err may be sent to
// another replica: it was answered 503, or found no server; a POST (not
// idempotent) only when it never left (the connection was refused).
func failover(method string, err error) bool {
	var he *HTTPError
	if errors.As(err, &he) {
		return he.StatusCode == http.StatusServiceUnavailable
	}
	var unreachable *unreachableError
	if !errors.As(err, &unreachable) {
		return false
	}
	if method != http.MethodPost {
		return true
	}
	var oe *net.OpError
	return errors.As(err, &oe) && oe.Op == "dial"
}

// unreachableError is a request that got no answer from a server.
type unreachableError struct {
	target string
	err    error
}

func (e *unreachableError) Error() string { return e.target + " unreachable: " + e.err.Error() }
func (e *unreachableError) Unwrap() error { return e.err }

// doAt sends one request to c.peers[k]; one that answers is asked first
// from then on.
func (c *Client) doAt(ctx context.Context, k int, method, path string, data []byte, hasBody bool, out any) error {
	p := c.peers[k]
	var rd io.Reader
	if hasBody {
		rd = bytes.NewReader(data)
	}
	req, err := http.NewRequestWithContext(ctx, method, p.base+path, rd)
	if err != nil {
		return fmt.Errorf("%s: %w", p.target, err)
	}
	if hasBody {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Accept", "application/json")
	resp, err := c.hc.Do(req)
	if err != nil {
		var na *noAgentError
		if errors.As(err, &na) {
			return na
		}
		var imp *ImpostorError
		if errors.As(err, &imp) {
			return imp
		}
		if ctxErr := ctx.Err(); ctxErr != nil {
			return fmt.Errorf("%s: %s %s: %w", p.target, method, path, ctxErr)
		}
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		var rh tls.RecordHeaderError
		if strings.HasPrefix(p.base, "https://") && (errors.As(err, &rh) || strings.Contains(err.Error(), "HTTP response to HTTPS client")) {
			return fmt.Errorf("%s does not speak TLS (was it started with --insecure? then its URL is http://...): %w", p.target, err)
		}
		return &unreachableError{target: p.target, err: err}
	}
	defer resp.Body.Close()
	c.cur.Store(int32(k))
	data, err = io.ReadAll(io.LimitReader(resp.Body, maxBody))
	if err != nil {
		return fmt.Errorf("%s: %s %s: reading answer: %w", p.target, method, path, err)
	}
	if resp.StatusCode == http.StatusBadRequest && bytes.Contains(data, []byte("HTTP request to an HTTPS server")) {
		return &HTTPError{StatusCode: resp.StatusCode,
			Message: fmt.Sprintf("%s serves HTTPS: use https://%s with a client certificate (--tls-cert, --tls-key, --tls-ca; see `dysco certs`)", p.target, strings.TrimPrefix(p.base, "http://"))}
	}
	if resp.StatusCode/100 != 2 {
		var e Error
		if json.Unmarshal(data, &e) == nil && e.Error != "" {
			return &HTTPError{StatusCode: resp.StatusCode, Message: e.Error}
		}
		msg := strings.TrimSpace(string(data))
		if len(msg) > 200 {
			msg = msg[:200] + "..."
		}
		return &HTTPError{StatusCode: resp.StatusCode,
			Message: fmt.Sprintf("%s: %s %s: %s: %s", p.target, method, path, resp.Status, msg)}
	}
	if out == nil || resp.StatusCode == http.StatusNoContent {
		return nil
	}
	if err := json.Unmarshal(data, out); err != nil {
		return fmt.Errorf("%s: %s %s: decoding answer: %w", p.target, method, path, err)
	}
	return nil
}

// noAgentError is a failure to dial the agent's socket. It reads as
// ErrNoAgent, followed by the cause when that is not the usual "nobody
// listens".
type noAgentError struct{ cause error }

func (e *noAgentError) Error() string {
	if errors.Is(e.cause, syscall.ECONNREFUSED) || errors.Is(e.cause, syscall.ENOENT) {
		return ErrNoAgent.Error()
	}
	return ErrNoAgent.Error() + ": " + e.cause.Error()
}

func (e *noAgentError) Unwrap() []error { return []error{ErrNoAgent, e.cause} }

// Prepend asks the agent to put hops at the head of a pending session's
// address list.
func (c *Client) Prepend(ctx context.Context, req PrependRequest) (PrependReply, error) {
	var out PrependReply
	err := c.do(ctx, http.MethodPost, "/v1/sessions/prepend", req, &out)
	return out, err
}

// ReconfigSlack is how much longer than a reconfiguration request's
// TimeoutMS a Client waits for the agent's answer: the agent answers when
// its own wait ends, and the answer needs time to arrive.
const ReconfigSlack = 5 * time.Second

// DefaultReconfigWait bounds a reconfiguration request that leaves the wait
// to the agent (TimeoutMS 0, or a Splice with Wait), whose default the
// client cannot know; agents' defaults must stay well below it.
const DefaultReconfigWait = time.Minute

// Reconfig asks the agent, as left anchor, to reconfigure every live session
// matching req.Match between itself and req.To (paper §3.1); the reply has
// one result per session. The call lasts until the agent has every result
// or its wait (req.TimeoutMS) ends; an HTTP error carries the agent's
// message (bad filter, bad addresses).
func (c *Client) Reconfig(ctx context.Context, req ReconfigRequest) (ReconfigReply, error) {
	ctx, cancel := c.reconfigContext(ctx, req.TimeoutMS)
	defer cancel()
	var out ReconfigReply
	err := c.do(ctx, http.MethodPost, "/v1/reconfig", req, &out)
	return out, err
}

// Rebind asks the agent to move the matching sessions this host is an end
// of to another of its addresses by rebinds (RebindRequest); the reply has
// one result per session.
func (c *Client) Rebind(ctx context.Context, req RebindRequest) (ReconfigReply, error) {
	ctx, cancel := c.reconfigContext(ctx, req.TimeoutMS)
	defer cancel()
	var out ReconfigReply
	err := c.do(ctx, http.MethodPost, "/v1/rebind", req, &out)
	return out, err
}

// ReconfigHistory lists the last reconfigurations the agent ran as left
// anchor, oldest first.
func (c *Client) ReconfigHistory(ctx context.Context) (ReconfigReply, error) {
	var out ReconfigReply
	err := c.do(ctx, http.MethodGet, "/v1/reconfig/history", nil, &out)
	return out, err
}

// Middlebox asks the agent of a middlebox host to take the host out of
// (req.With empty), or replace it in, every matching session passing
// through it (paper §2.3); the reply has one result per session.
func (c *Client) Middlebox(ctx context.Context, req MiddleboxRequest) (ReconfigReply, error) {
	ctx, cancel := c.reconfigContext(ctx, req.TimeoutMS)
	defer cancel()
	var out ReconfigReply
	err := c.do(ctx, http.MethodPost, "/v1/middlebox", req, &out)
	return out, err
}

// Splice hands the agent the two sockets a session-terminating proxy is
// splicing (paper §2.4, §4.2), so that the proxy leaves the session's path.
// With req.Wait the call lasts until the removal is over and the reply
// carries its result.
func (c *Client) Splice(ctx context.Context, req SpliceRequest) (SpliceReply, error) {
	if req.Wait {
		var cancel context.CancelFunc
		ctx, cancel = c.reconfigContext(ctx, 0)
		defer cancel()
	}
	var out SpliceReply
	err := c.do(ctx, http.MethodPost, "/v1/sessions/splice", req, &out)
	return out, err
}

// reconfigContext bounds a request on which the agent itself waits up to
// timeoutMS milliseconds (0: its default): the client waits that long plus
// ReconfigSlack (DefaultReconfigWait when timeoutMS is not positive), or
// c.Timeout if that is longer. A shorter deadline of ctx still applies.
func (c *Client) reconfigContext(ctx context.Context, timeoutMS int) (context.Context, context.CancelFunc) {
	wait := DefaultReconfigWait
	if timeoutMS > 0 {
		// Beyond a day, the agent's wait is no bound worth keeping
		// (and time.Duration would overflow for absurd values).
		wait = time.Duration(min(int64(timeoutMS), int64(24*time.Hour/time.Millisecond)))*time.Millisecond + ReconfigSlack
	}
	if c.Timeout > wait {
		wait = c.Timeout
	}
	return context.WithTimeout(ctx, wait)
}

// CreateOperation asks the policy server to relay op to the agent op.Host
// and returns it as queued, with its ID. Policy server only.
func (c *Client) CreateOperation(ctx context.Context, op Operation) (Operation, error) {
	var out Operation
	err := c.do(ctx, http.MethodPost, "/v1/operations", op, &out)
	return out, err
}

// Operation returns the operation id. With wait > 0 the server answers
// when the operation finishes or wait has passed, whichever comes first.
// Policy server only.
func (c *Client) Operation(ctx context.Context, id string, wait time.Duration) (Operation, error) {
	path := "/v1/operations/" + url.PathEscape(id)
	if wait > 0 {
		path += "?wait=" + strconv.Itoa(int((wait+time.Second-1)/time.Second))
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, wait+DefaultTimeout)
		defer cancel()
	}
	var out Operation
	err := c.do(ctx, http.MethodGet, path, nil, &out)
	return out, err
}

// Operations lists the operations the policy server keeps, oldest first.
func (c *Client) Operations(ctx context.Context) ([]Operation, error) {
	var out []Operation
	err := c.do(ctx, http.MethodGet, "/v1/operations", nil, &out)
	return out, err
}

// ClaimOperation long-polls the policy server for the next operation for
// the agent host: ok is false when none came within wait. Policy server
// only; agents call it.
func (c *Client) ClaimOperation(ctx context.Context, host string, wait time.Duration) (op Operation, ok bool, err error) {
	q := url.Values{}
	q.Set("host", host)
	q.Set("wait", strconv.Itoa(int(wait/time.Second)))
	ctx, cancel := context.WithTimeout(ctx, wait+DefaultTimeout)
	defer cancel()
	if err := c.do(ctx, http.MethodPost, "/v1/operations/claim?"+q.Encode(), nil, &op); err != nil {
		return Operation{}, false, err
	}
	return op, op.ID != "", nil
}

// ReportOperation gives the policy server an agent's result for the
// operation id it claimed.
func (c *Client) ReportOperation(ctx context.Context, id string, res OperationResult) error {
	return c.do(ctx, http.MethodPut, "/v1/operations/"+url.PathEscape(id)+"/result", res, nil)
}
