package bench

// Datagrams lost across reconfigurations of a live UDP session
// (docs/protocol.md, "UDP sessions"): the Dysco lab's middleboxes are
// deleted and inserted back in turns under an iperf3 -u stream, and the
// receiver counts what it lost. Datagrams that overflowed the receiver's
// socket buffer (iperf3 -u's receiver is CPU-bound on a shared machine,
// more so while the agents and the CLI work) count apart: they reached the
// server. The same stream without reconfigurations, just before, is the
// reference: what the lab loses by itself.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/labkit"
)

// udpReconfigMaxRate caps the stream's rate: above it, a shared two-core
// machine drops datagrams in its sockets whatever the path does.
const udpReconfigMaxRate = 500e6

// udpReconfigPort is the stream's source port (iperf3 --cport): the
// reconfigurations match its session only, not those of the UDP
// benchmarks before it, which are idle but not yet timed out.
const udpReconfigPort = 5299

// UDPReconfigDetails is the raw data of the figure.
type UDPReconfigDetails struct {
	RateMbps  float64   `json:"rate_mbps"`
	Secs      int       `json:"secs"`
	Reference UDPResult `json:"reference"` // the same stream, no reconfiguration
	Run       UDPResult `json:"run"`
	// RefRcvbuf and RunRcvbuf are the server's UDP receive-buffer
	// overflows (RcvbufErrors of /proc/net/snmp) during each stream.
	RefRcvbuf uint64               `json:"ref_rcvbuf_errors"`
	RunRcvbuf uint64               `json:"run_rcvbuf_errors"`
	Results   []api.ReconfigResult `json:"results"` // every reconfiguration, in order
	// Drops are the datapath's drop counters of the client, the
	// middleboxes and the server over the run; Counters all that moved.
	Drops    map[string]uint64            `json:"drops"`
	Counters map[string]map[string]uint64 `json:"counters"`
	Errors   []string                     `json:"errors,omitempty"`
}

// PathLost is the datagrams of a stream lost before the server's socket:
// those iperf3 reports lost, less those the socket buffer overflowed with.
func pathLost(res UDPResult, rcvbuf uint64) int64 {
	return res.Lost - int64(rcvbuf)
}

// benchUDPReconfig measures the datagrams lost while the client deletes the
// chain of a live UDP session and inserts it back, in turns, for the whole
// stream.
func benchUDPReconfig(ctx context.Context, o *Options, p *labkit.Pair, r *Report, pr *labkit.Progress, rate float64) error {
	rate = math.Min(rate, udpReconfigMaxRate)
	secs := 8
	if o.Quick {
		secs = 3
	}
	v := p.Dysco
	d := &UDPReconfigDetails{RateMbps: rate / 1e6, Secs: secs, Drops: map[string]uint64{}, Counters: map[string]map[string]uint64{}}
	key := fmt.Sprintf("udp-reconfig-%dmb", p.NMB)
	r.Details[key] = d
	argv := udpReconfigArgv(v, secs, rate)
	stream := func() (UDPResult, uint64, error) {
		rb0, err := udpRcvbufErrors(ctx, v)
		if err != nil {
			return UDPResult{}, 0, err
		}
		s, err := labkit.Run(ctx, v.Lab, "client", time.Duration(secs)*time.Second+60*time.Second, argv...)
		if err != nil {
			return UDPResult{}, 0, fmt.Errorf("iperf3 -u: %w", err)
		}
		res, err := parseIperfUDP(s)
		if err != nil {
			return res, 0, err
		}
		rb1, err := udpRcvbufErrors(ctx, v)
		return res, rb1 - rb0, err
	}
	ref, rb, err := stream()
	if err != nil {
		return fmt.Errorf("udp across reconfigurations: the reference stream: %w", err)
	}
	d.Reference, d.RefRcvbuf = ref, rb
	pr.Logf("udp across reconfigurations: reference stream, %d of %d datagrams lost, %d of them in the server's socket buffer", ref.Lost, ref.Packets, rb)

	hosts := append(append([]string{"client"}, v.MBs...), "server")
	before := map[string]*api.Status{}
	for _, h := range hosts {
		if before[h], err = labkit.AgentStatus(ctx, o.Dysco, v.Lab, h); err != nil {
			return err
		}
	}
	type out struct {
		res UDPResult
		rb  uint64
		err error
	}
	done := make(chan out, 1)
	go func() {
		res, rb, err := stream()
		done <- out{res, rb, err}
	}()
	// The stream's session answered at the client: from then on it can
	// be reconfigured.
	start := time.Now()
	for {
		ok, err := udpSessionUp(ctx, o, v)
		if err != nil {
			return err
		}
		if ok {
			break
		}
		if time.Since(start) > 10*time.Second {
			return errors.New("udp across reconfigurations: no established UDP session at the client after 10 s")
		}
		if err := labkit.SleepCtx(ctx, 20*time.Millisecond); err != nil {
			return err
		}
	}
	var chain []string
	for _, a := range p.Chain {
		chain = append(chain, a.String())
	}
	match := fmt.Sprintf("udp and src port %d and dst port %d", udpReconfigPort, labkit.IperfPort)
	steps := [][]string{{"--to", v.Server.String()}, {"--to", v.Server.String(), "--chain", strings.Join(chain, ",")}}
	// Until a second before the stream ends, one reconfiguration after
	// the other; the last one puts the chain back.
	end := start.Add(time.Duration(secs-1) * time.Second)
	for i := 0; time.Now().Before(end) || i%2 == 1; i++ {
		args := append([]string{"reconfig", "--json", "--timeout", "10s", "--match", match}, steps[i%2]...)
		s, err := labkit.DyscoCLI(ctx, o.Dysco, v.Lab, "client", args...)
		var rep api.ReconfigReply
		if jerr := json.Unmarshal([]byte(s), &rep); jerr != nil || len(rep.Results) == 0 {
			d.Errors = append(d.Errors, fmt.Sprintf("step %d: %v %v: %s", i, err, jerr, labkit.Tail(s, 200)))
			break
		}
		d.Results = append(d.Results, rep.Results...)
	}
	res := <-done
	if res.err != nil {
		return fmt.Errorf("udp across reconfigurations: %w", res.err)
	}
	d.Run, d.RunRcvbuf = res.res, res.rb
	for _, h := range hosts {
		after, err := labkit.AgentStatus(ctx, o.Dysco, v.Lab, h)
		if err != nil {
			return err
		}
		delta := labkit.CounterDelta(before[h], after)
		d.Counters[h] = delta
		for k, n := range labkit.Drops(delta) {
			d.Drops[h+" "+k] += n
		}
	}
	r.add(udpReconfigFigure(key, p, d))
	return nil
}

func udpReconfigArgv(v *labkit.Variant, secs int, rate float64) []string {
	return append(iperfUDPArgv(v.Server.String(), secs, 0, 1, rate), "--cport", strconv.Itoa(udpReconfigPort), "-w", "4M")
}

// udpSessionUp tells whether the client has an established session of the
// stream.
func udpSessionUp(ctx context.Context, o *Options, v *labkit.Variant) (bool, error) {
	s, err := labkit.DyscoCLI(ctx, o.Dysco, v.Lab, "client", "sessions", "-o", "json")
	if err != nil {
		return false, err
	}
	var ss []api.Session
	if err := json.Unmarshal([]byte(s), &ss); err != nil {
		return false, fmt.Errorf("dysco sessions: %w", err)
	}
	suffix := fmt.Sprintf(":%d -> %s:%d", udpReconfigPort, v.Server, labkit.IperfPort)
	for _, x := range ss {
		if x.Proto == "udp" && x.State == "established" && strings.HasSuffix(x.Session, suffix) {
			return true, nil
		}
	}
	return false, nil
}

// udpRcvbufErrors reads the server's count of UDP datagrams dropped for a
// full receive buffer (IPv4: Udp RcvbufErrors of /proc/net/snmp).
func udpRcvbufErrors(ctx context.Context, v *labkit.Variant) (uint64, error) {
	s, err := labkit.Run(ctx, v.Lab, "server", 10*time.Second, "cat", "/proc/net/snmp")
	if err != nil {
		return 0, err
	}
	var names []string
	for _, line := range strings.Split(s, "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || f[0] != "Udp:" {
			continue
		}
		if names == nil {
			names = f[1:]
			continue
		}
		for i, n := range names {
			if n == "RcvbufErrors" && i+1 < len(f) {
				return strconv.ParseUint(f[i+1], 10, 64)
			}
		}
	}
	return 0, errors.New("/proc/net/snmp of the server has no Udp RcvbufErrors")
}

// udpReconfigFigure is the figure of the run: datagrams lost on the path
// with reconfigurations against the reference stream's.
func udpReconfigFigure(key string, p *labkit.Pair, d *UDPReconfigDetails) *Figure {
	ok, times := 0, []float64{}
	var bad []string
	for _, x := range d.Results {
		if x.Outcome == "succeeded" {
			ok++
			times = append(times, float64(x.Micros)/1000)
		} else {
			bad = append(bad, x.Outcome+": "+x.Reason)
		}
	}
	var drops uint64
	for _, n := range d.Drops {
		drops += n
	}
	lost, refLost := pathLost(d.Run, d.RunRcvbuf), pathLost(d.Reference, d.RefRcvbuf)
	cmd := fmt.Sprintf("ip netns exec LAB-client %s; meanwhile, in turns until a second before its end: "+
		"ip netns exec LAB-client dysco reconfig --json --match 'udp and src port %d and dst port %d' --to %s [--chain %s]",
		strings.Join(udpReconfigArgv(p.Dysco, d.Secs, d.RateMbps*1e6), " "), udpReconfigPort, labkit.IperfPort, p.Dysco.Server, p.Chain[0])
	f := &Figure{
		Key:          key,
		Name:         fmt.Sprintf("UDP datagrams lost on the path across reconfigurations (the chain of a live iperf3 -u stream deleted and inserted back in turns), %d mb", p.NMB),
		Command:      cmd,
		Unit:         "datagrams lost",
		Dysco:        float64(lost),
		Baseline:     float64(refLost),
		DyscoText:    fmt.Sprintf("%d of %d across %d reconfigurations (iperf3: %d lost, %d of them in the server's socket buffer)", lost, d.Run.Packets, ok, d.Run.Lost, d.RunRcvbuf),
		BaselineText: fmt.Sprintf("%d of %d with none, same lab just before (iperf3: %d lost, %d in the socket buffer)", refLost, d.Reference.Packets, d.Reference.Lost, d.RefRcvbuf),
		Ratio:        math.NaN(),
		Measured:     float64(lost),
		MeasuredUnit: "datagrams lost on the path",
		Target:       "0 lost on the path and 0 dropped by the datapath, every reconfiguration succeeded",
		Met:          metStr(lost == 0 && drops == 0 && len(bad) == 0 && len(d.Errors) == 0 && ok >= 2),
	}
	f.Note = fmt.Sprintf("%.0f Mbit/s (the 1-flow lossless rate found on the baseline, at most %.0f), %d s; %d reconfigurations succeeded, median %.2f ms, max %.2f ms; "+
		"lost on the path = iperf3's lost datagrams less the server's UDP RcvbufErrors (/proc/net/snmp) over the stream; "+
		"drops at the client, the middleboxes and the server: %s",
		d.RateMbps, udpReconfigMaxRate/1e6, d.Secs, ok, labkit.Median(times), labkit.Quantile(times, 1), labkit.OrText(labkit.CountsText(d.Drops), "none"))
	if len(bad) > 0 {
		f.Note += "; not succeeded: " + strings.Join(labkit.FirstN(bad, 3), "; ")
	}
	if len(d.Errors) > 0 {
		f.Note += "; errors: " + strings.Join(d.Errors, "; ")
	}
	return f
}
