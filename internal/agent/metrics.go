package agent

import (
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

type metrics struct {
	reg       *prometheus.Registry
	collected prometheus.Counter
}

// newMetrics registers the agent's metrics: datapath counters (set-ups,
// rewrites, drops by reason) and live sessions are read from the maps at
// scrape time.
func newMetrics(a *Agent) *metrics {
	m := &metrics{reg: prometheus.NewRegistry()}
	m.collected = prometheus.NewCounter(prometheus.CounterOpts{Name: "dysco_sessions_collected_total", Help: "Sessions ended and removed by the collector."})
	m.reg.MustRegister(m.collected, &dpCollector{a: a})
	return m
}

func (m *metrics) serve(addr string) (*http.Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("agent: metrics on %s: %w", addr, err)
	}
	srv := &http.Server{Handler: promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{}), ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(ln)
	return srv, nil
}

type dpCollector struct{ a *Agent }

var (
	descCounter  = prometheus.NewDesc("dysco_datapath_events_total", "Datapath events by kind (set-ups, rewrites, drops by reason).", []string{"event"}, nil)
	descSessions = prometheus.NewDesc("dysco_sessions", "Live sessions on this host by role and state.", []string{"role", "state"}, nil)
	descHop      = prometheus.NewDesc("dysco_hop_packets_total", "Packets of live sessions by direction.", []string{"direction"}, nil)
	descHopBytes = prometheus.NewDesc("dysco_hop_bytes_total", "Bytes of live sessions by direction.", []string{"direction"}, nil)
)

func (c *dpCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descCounter
	ch <- descSessions
	ch <- descHop
	ch <- descHopBytes
}

func (c *dpCollector) Collect(ch chan<- prometheus.Metric) {
	if st, err := c.a.dp.Stats(); err == nil {
		for k, v := range st {
			ch <- prometheus.MustNewConstMetric(descCounter, prometheus.CounterValue, float64(v), k)
		}
	}
	sess, err := c.a.sessionList()
	if err != nil {
		return
	}
	type rs struct{ role, state string }
	counts := map[rs]int{}
	var pf, pr, bf, br uint64
	for _, s := range sess {
		counts[rs{s.Role, s.State}]++
		pf += s.PacketsFwd
		pr += s.PacketsRev
		bf += s.BytesFwd
		br += s.BytesRev
	}
	for k, n := range counts {
		ch <- prometheus.MustNewConstMetric(descSessions, prometheus.GaugeValue, float64(n), k.role, k.state)
	}
	ch <- prometheus.MustNewConstMetric(descHop, prometheus.CounterValue, float64(pf), "forward")
	ch <- prometheus.MustNewConstMetric(descHop, prometheus.CounterValue, float64(pr), "reverse")
	ch <- prometheus.MustNewConstMetric(descHopBytes, prometheus.CounterValue, float64(bf), "forward")
	ch <- prometheus.MustNewConstMetric(descHopBytes, prometheus.CounterValue, float64(br), "reverse")
}
