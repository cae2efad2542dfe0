package policyserver

import (
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// initMetrics creates the server's metrics: gauges read at scrape time and
// the refusal counter, on a registry of its own (so that two servers in one
// process, as in tests, do not collide), plus the Go and process collectors.
func (s *Server) initMetrics() {
	reg := prometheus.NewRegistry()
	s.reg = reg
	s.refused = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "dysco", Subsystem: "policyserver", Name: "requests_refused_total",
		Help: "Requests refused: code 401 (reason no_certificate, bad_certificate, no_tls) or 403 (role, other_host), by route.",
	}, []string{"route", "code", "reason"})
	s.handshakeErrors = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "dysco", Subsystem: "policyserver", Name: "tls_handshake_errors_total",
		Help: "Connections whose TLS handshake failed (plain HTTP to the TLS listener, a client that does not trust the server's certificate).",
	})
	reg.MustRegister(s.refused, s.handshakeErrors)
	gauge := func(name, help string, f func() float64) {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Namespace: "dysco", Subsystem: "policyserver", Name: name, Help: help,
		}, f))
	}
	gauge("policies", "Number of policies stored.", func() float64 { return float64(len(s.Current().Policies)) })
	gauge("types", "Number of middlebox types stored.", func() float64 { return float64(len(s.Current().Types)) })
	gauge("version", "Version of the policy set; bumped on every change.", func() float64 { return float64(s.Current().Version) })
	gauge("watchers", "Agents waiting in a long poll on /v1/watch.", func() float64 { return float64(s.watchers.Load()) })
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
}

// metricsHandler returns the /metrics handler (of the metrics listener).
func (s *Server) metricsHandler() http.Handler {
	return promhttp.HandlerFor(s.reg, promhttp.HandlerOpts{ErrorLog: slogPromLogger{s}})
}

// slogPromLogger passes promhttp's errors to the server's log.
type slogPromLogger struct{ s *Server }

func (l slogPromLogger) Println(v ...any) { l.s.log.Error("metrics", "err", v) }
