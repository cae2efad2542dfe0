package agent

import (
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/dysco/dysco/internal/datapath"
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
	descHop      = prometheus.NewDesc("dysco_hop_packets", "Packets of live sessions exchanged with each neighbouring hop of their chains (to: sent on a subsession to it; from: received on one from it).", []string{"hop", "direction"}, nil)
	descHopBytes = prometheus.NewDesc("dysco_hop_bytes", "Bytes of live sessions exchanged with each neighbouring hop of their chains.", []string{"hop", "direction"}, nil)
	descRefused  = prometheus.NewDesc("dysco_policies_refused_total", "Policies the agent refused to install, each time it was asked to, by reason: unchained (the filter matches no protocol the datapath chains) or filter (it does not compile).", []string{"reason"}, nil)
)

func (c *dpCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descCounter
	ch <- descSessions
	ch <- descHop
	ch <- descHopBytes
	ch <- descRefused
}

func (c *dpCollector) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(descRefused, prometheus.CounterValue, float64(c.a.refusedUnchained.Load()), "unchained")
	ch <- prometheus.MustNewConstMetric(descRefused, prometheus.CounterValue, float64(c.a.refusedFilter.Load()), "filter")
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
	for _, s := range sess {
		counts[rs{s.Role, s.State}]++
	}
	for k, n := range counts {
		ch <- prometheus.MustNewConstMetric(descSessions, prometheus.GaugeValue, float64(n), k.role, k.state)
	}
	// Per hop: subsession flows, by the neighbour at their other end.
	type hd struct{ hop, dir string }
	pk, by := map[hd]uint64{}, map[hd]uint64{}
	_ = c.a.dp.EachFlow(func(k *datapath.Tuple, f *datapath.Flow) {
		var key hd
		switch {
		case f.Flags&datapath.FlIngress != 0 && f.Flags&(datapath.FlSYNStrip|datapath.FlRev) != 0:
			key = hd{k.Wire().Src.String(), "from"}
		case f.Flags&datapath.FlIngress == 0 && k.Daddr != f.Out.Daddr:
			key = hd{f.Out.Wire().Dst.String(), "to"}
		default:
			return
		}
		pk[key] += f.Packets
		by[key] += f.Bytes
	})
	for k, v := range pk {
		ch <- prometheus.MustNewConstMetric(descHop, prometheus.GaugeValue, float64(v), k.hop, k.dir)
		ch <- prometheus.MustNewConstMetric(descHopBytes, prometheus.GaugeValue, float64(by[k]), k.hop, k.dir)
	}
}
