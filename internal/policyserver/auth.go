package policyserver

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/dysco/dysco/internal/certs"
)

// Authentication and roles. The policy server serves HTTPS and asks every
// client for a certificate signed by the deployment's CA (internal/certs):
// the certificate names its holder and carries one role. Operators change
// policies and types and queue operations; agents watch their own policies
// and claim and report their own operations, the host being the name in
// their certificate; monitors read. A request without a valid certificate,
// or with one on the CA's revocation list (certs.Revocations, checked on
// every request), is answered 401, one beyond its role 403, and both are
// counted in dysco_policyserver_requests_refused_total{route, code, reason}.
//
// With Config.Insecure the server serves plain HTTP and trusts everyone:
// every request may do anything, and agents name themselves with host=.

// Reasons of a refusal, the "reason" label of the refused counter.
const (
	reasonNoCert    = "no_certificate"  // 401: the client sent none
	reasonBadCert   = "bad_certificate" // 401: not signed by the CA, expired, not a client certificate, no role
	reasonRole      = "role"            // 403: the route is not for the certificate's role
	reasonOtherHost = "other_host"      // 403: an agent asked for another host's policies or operations
	reasonNoTLS     = "no_tls"          // 401: a request that did not come over TLS
	reasonRevoked   = "revoked"         // 401: the certificate is on the CA's revocation list
)

// Role sets of the routes.
var (
	anyRole      = certs.Roles
	operatorOnly = []string{certs.RoleOperator}
	agentOnly    = []string{certs.RoleAgent}
	readers      = []string{certs.RoleOperator, certs.RoleMonitor}
	watchers     = []string{certs.RoleOperator, certs.RoleAgent}
)

type identityKey struct{}

// identity is who made a request: the certificate's identity, or the zero
// value on an insecure server (anyone, anything).
func identity(r *http.Request) certs.Identity {
	id, _ := r.Context().Value(identityKey{}).(certs.Identity)
	return id
}

type routeKey struct{}

// route is the pattern of the route r came in on (for the counters).
func route(r *http.Request) string {
	s, _ := r.Context().Value(routeKey{}).(string)
	return s
}

// guard serves h on pattern to the roles given, after checking the client's
// certificate.
func (s *Server) guard(pattern string, roles []string, h http.HandlerFunc) {
	// The label is the route without its method and parameters' names.
	label := pattern
	if i := strings.IndexByte(label, ' '); i >= 0 {
		label = label[i+1:]
	}
	s.mux.Handle(pattern, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := context.WithValue(r.Context(), routeKey{}, label)
		if s.roots == nil { // insecure
			h(w, r.WithContext(ctx))
			return
		}
		if r.TLS == nil {
			s.refuse(w, r, label, http.StatusUnauthorized, reasonNoTLS, errors.New("this policy server takes requests over TLS only"))
			return
		}
		if len(r.TLS.PeerCertificates) == 0 {
			s.refuse(w, r, label, http.StatusUnauthorized, reasonNoCert,
				errors.New("no client certificate: this policy server authenticates its clients with certificates of its CA (`dysco certs`; the CLI's --tls-cert, --tls-key, --tls-ca)"))
			return
		}
		id, err := s.verify(r)
		if err != nil {
			s.refuse(w, r, label, http.StatusUnauthorized, reasonBadCert, err)
			return
		}
		// Checked on every request, not once per connection: a
		// revocation cuts a connection that is open already.
		if leaf := r.TLS.PeerCertificates[0]; s.revoked != nil && s.revoked.Revoked(leaf) {
			s.refuse(w, r, label, http.StatusUnauthorized, reasonRevoked,
				fmt.Errorf("client certificate %q (serial %s) is revoked: ask for a new one", leaf.Subject.CommonName, fmt.Sprintf("%X", leaf.SerialNumber)))
			return
		}
		if !slices.Contains(roles, id.Role) {
			s.refuse(w, r, label, http.StatusForbidden, reasonRole,
				fmt.Errorf("%s %s is not for the %s role (certificate %q; allowed: %s)", r.Method, r.URL.Path, id.Role, id.Name, strings.Join(roles, ", ")))
			return
		}
		h(w, r.WithContext(context.WithValue(ctx, identityKey{}, id)))
	}))
}

// connAuth caches the verification of a connection's client certificate:
// the certificate of a TLS connection does not change, so it is verified
// on the connection's first request, and again only once it has expired.
type connAuth struct {
	mu       sync.Mutex
	done     bool
	id       certs.Identity
	err      error
	notAfter time.Time
}

type connAuthKey struct{}

// verify verifies the client certificate of r, once per connection when
// the server set up the cache (Serve's ConnContext).
func (s *Server) verify(r *http.Request) (certs.Identity, error) {
	now := time.Now()
	ca, ok := r.Context().Value(connAuthKey{}).(*connAuth)
	if !ok {
		return certs.Verify(r.TLS.PeerCertificates, s.roots, now)
	}
	ca.mu.Lock()
	defer ca.mu.Unlock()
	if !ca.done || now.After(ca.notAfter) {
		ca.id, ca.err = certs.Verify(r.TLS.PeerCertificates, s.roots, now)
		ca.notAfter, ca.done = r.TLS.PeerCertificates[0].NotAfter, true
	}
	return ca.id, ca.err
}

// refuse answers a request with code and counts it.
func (s *Server) refuse(w http.ResponseWriter, r *http.Request, label string, code int, reason string, err error) {
	s.refused.WithLabelValues(label, fmt.Sprint(code), reason).Inc()
	s.log.Warn("request refused", "route", label, "code", code, "reason", reason, "remote", r.RemoteAddr, "err", err)
	writeError(w, code, err)
}

// maxHostLen bounds a host name given as a parameter (api.Operation's rule).
const maxHostLen = 253

// agentHost is the host a watch or claim is for: an agent's own name (a
// host= naming another is refused, 403), or host= for an operator or on an
// insecure server. ok is false when the request was answered.
func (s *Server) agentHost(w http.ResponseWriter, r *http.Request, what string) (host string, ok bool) {
	param := r.URL.Query().Get("host")
	if id := identity(r); id.Role == certs.RoleAgent {
		if param != "" && param != id.Name {
			s.refuse(w, r, route(r), http.StatusForbidden, reasonOtherHost,
				fmt.Errorf("%s: the agent certificate %q may not ask for host %q", what, id.Name, param))
			return "", false
		}
		return id.Name, true
	}
	if param == "" {
		writeError(w, http.StatusBadRequest, fmt.Errorf("%s needs host=NAME, the name of the agent asking", what))
		return "", false
	}
	if len(param) > maxHostLen || strings.IndexFunc(param, func(r rune) bool { return r <= ' ' || r == 0x7f }) >= 0 {
		writeError(w, http.StatusBadRequest, fmt.Errorf("%s: host=%.40q is not an agent name (at most %d bytes, no spaces or control characters)", what, param, maxHostLen))
		return "", false
	}
	return param, true
}
