package bench

// UDP sessions (docs/architecture.md, "UDP sessions"): iperf3 -u goodput
// at the highest rate the baseline carries without loss, and HTTP/3
// downloads with dysco-h3. Both labs of a pair get the UDP policy
// (Pair.AddUDPPolicy) before the first UDP benchmark on it.

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/dysco/dysco/internal/labkit"
)

// udpDatagram is iperf3 -u's datagram payload (-l): below the veth MTU
// with room for the address-list block that a session's first datagrams
// carry.
const udpDatagram = 1400

// udpMaxLoss is the loss (in per cent of datagrams) under which the rate
// search takes a rate as carried.
const udpMaxLoss = 0.1

// UDPResult is one iperf3 -u run.
type UDPResult struct {
	Gbps    float64 `json:"gbps"`    // receiver's goodput
	Lost    int64   `json:"lost"`    // datagrams lost
	Packets int64   `json:"packets"` // datagrams sent
}

// LossPct is the loss in per cent of the datagrams sent.
func (u UDPResult) LossPct() float64 {
	if u.Packets <= 0 {
		return math.NaN()
	}
	return 100 * float64(u.Lost) / float64(u.Packets)
}

// iperfUDPArgv is the iperf3 -u client command line; rate is the total of
// all streams in bit/s (iperf3's -b is per stream).
func iperfUDPArgv(server string, secs, omit, streams int, rate float64) []string {
	return []string{"iperf3", "-c", server, "-p", strconv.Itoa(labkit.IperfPort), "-u",
		"-b", strconv.FormatFloat(math.Round(rate/float64(streams)), 'f', 0, 64), "-l", strconv.Itoa(udpDatagram),
		"-t", strconv.Itoa(secs), "-O", strconv.Itoa(omit), "-P", strconv.Itoa(streams), "-J", "--connect-timeout", "5000"}
}

// parseIperfUDP reads the receiver's figures of iperf3 -u -J output.
func parseIperfUDP(out string) (UDPResult, error) {
	type sum struct {
		BitsPerSecond float64 `json:"bits_per_second"`
		Lost          int64   `json:"lost_packets"`
		Packets       int64   `json:"packets"`
	}
	var r struct {
		Error string `json:"error"`
		End   struct {
			Sum         *sum `json:"sum"`
			SumReceived *sum `json:"sum_received"`
		} `json:"end"`
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		return UDPResult{}, fmt.Errorf("iperf3 output is not JSON: %w: %s", err, labkit.Tail(out, 300))
	}
	if r.Error != "" {
		return UDPResult{}, fmt.Errorf("iperf3: %s", r.Error)
	}
	s := r.End.SumReceived
	if s == nil {
		s = r.End.Sum // iperf3 before 3.11 has no sum_received for UDP
	}
	if s == nil || s.Packets <= 0 {
		return UDPResult{}, fmt.Errorf("iperf3 reported no datagrams: %s", labkit.Tail(out, 300))
	}
	return UDPResult{Gbps: s.BitsPerSecond / 1e9, Lost: s.Lost, Packets: s.Packets}, nil
}

// runIperfUDP runs iperf3 -u at the client of v.
func runIperfUDP(ctx context.Context, v *labkit.Variant, secs, omit, streams int, rate float64) (UDPResult, error) {
	out, err := labkit.Run(ctx, v.Lab, "client", time.Duration(secs+omit)*time.Second+60*time.Second, iperfUDPArgv(v.Server.String(), secs, omit, streams, rate)...)
	if err != nil {
		return UDPResult{}, err
	}
	return parseIperfUDP(out)
}

// UDPSearchStep is one rate tried by the rate search.
type UDPSearchStep struct {
	RateMbps float64 `json:"rate_mbps"`
	UDPResult
	OK bool `json:"ok"`
}

// searchUDPRate finds the highest rate the baseline lab carries with
// under udpMaxLoss % of the datagrams lost and at least 95 % of it
// received: from 1 Gbit/s, doubling while
// it does and halving while it does not, then one step halfway between
// the last rate carried and the first one not.
func searchUDPRate(ctx context.Context, o *Options, v *labkit.Variant, streams int, pr *labkit.Progress) (float64, []UDPSearchStep, error) {
	secs := 2
	if o.Quick {
		secs = 1
	}
	var steps []UDPSearchStep
	try := func(rate float64) (bool, error) {
		res, err := runIperfUDP(ctx, v, secs, 0, streams, rate)
		if err != nil {
			return false, err
		}
		// Carried: next to no loss, and the sender reached the rate
		// (iperf3's sender is CPU-bound beyond some rate; above it the
		// comparison would be of the senders' CPU, not of the paths).
		ok := res.LossPct() < udpMaxLoss && res.Gbps*1e9 >= 0.95*rate
		steps = append(steps, UDPSearchStep{rate / 1e6, res, ok})
		pr.Logf("udp rate search, %d flow(s): %.0f Mbit/s: %.3g Gbit/s received, %d of %d datagrams lost", streams, rate/1e6, res.Gbps, res.Lost, res.Packets)
		return ok, nil
	}
	const lo, hi = 25e6, 32e9
	rate := 1e9
	good, bad := 0.0, 0.0
	for good == 0 || bad == 0 {
		ok, err := try(rate)
		if err != nil {
			return 0, steps, err
		}
		if ok {
			good = rate
			rate *= 2
		} else {
			bad = rate
			rate /= 2
		}
		if (good == 0 && rate < lo) || (bad == 0 && rate > hi) {
			break
		}
	}
	if good == 0 {
		return 0, steps, fmt.Errorf("the baseline loses %.1f %% or more of the datagrams even at %.0f Mbit/s", udpMaxLoss, lo/1e6)
	}
	if bad > 0 {
		mid := (good + bad) / 2
		ok, err := try(mid)
		if err != nil {
			return 0, steps, err
		}
		if ok {
			good = mid
		}
	}
	return good, steps, nil
}

// UDPGoodputDetails is the raw data of one UDP goodput comparison.
type UDPGoodputDetails struct {
	Flows    int             `json:"flows"`
	RateMbps float64         `json:"rate_mbps"`
	Search   []UDPSearchStep `json:"search"`
	Runs     []UDPResult     `json:"runs"` // in the order of Samples
	Samples  []Sample        `json:"samples"`
}

// benchUDP: iperf3 -u through one middlebox, 1 and 100 flows, at the
// highest rate the baseline carries without loss; then the datagrams lost
// across reconfigurations of a live stream (benchUDPReconfig).
func benchUDP(ctx context.Context, o *Options, p *labkit.Pair, r *Report, pr *labkit.Progress) error {
	if err := p.AddUDPPolicy(ctx); err != nil {
		return err
	}
	var rate1 float64 // the 1-flow rate
	for _, flows := range []int{1, 100} {
		d := &UDPGoodputDetails{Flows: flows}
		r.Details[fmt.Sprintf("udp-%dmb-P%d", p.NMB, flows)] = d
		rate, steps, err := searchUDPRate(ctx, o, p.Base, flows, pr)
		d.Search = steps
		if err != nil {
			return fmt.Errorf("udp, %d flow(s): rate search: %w", flows, err)
		}
		d.RateMbps = rate / 1e6
		if flows == 1 {
			rate1 = rate
		}
		secs := Secs(o.IperfTime)
		what := fmt.Sprintf("udp goodput, %d flow(s) at %.0f Mbit/s, %d mb", flows, rate/1e6, p.NMB)
		lost := map[string][2]int64{}
		ss, err := Interleaved(ctx, o, p, pr, what, func(v *labkit.Variant) (float64, string, error) {
			res, err := runIperfUDP(ctx, v, secs, 1, flows, rate)
			if err != nil {
				return 0, "", err
			}
			d.Runs = append(d.Runs, res)
			l := lost[v.Name]
			lost[v.Name] = [2]int64{l[0] + res.Lost, l[1] + res.Packets}
			return res.Gbps, "", nil
		})
		d.Samples = ss
		if err != nil {
			return err
		}
		cmd := "ip netns exec LAB-client " + strings.Join(iperfUDPArgv(p.Dysco.Server.String(), secs, 1, flows, rate), " ")
		f := ratioFigure(fmt.Sprintf("udp-%dmb-P%d", p.NMB, flows),
			fmt.Sprintf("UDP goodput, %d flow%s at the baseline's lossless rate, %d mb", flows, labkit.Plural(flows), p.NMB),
			cmd, "Gbit/s", ss, 0.95, "")
		lossText := func(name string) string {
			l := lost[name]
			return fmt.Sprintf("%s (lost %d of %d datagrams, %.3f %%)", fmtVal(labkit.Median(Values(ss, name)), "Gbit/s"), l[0], l[1], 100*float64(l[0])/math.Max(1, float64(l[1])))
		}
		f.DyscoText, f.BaselineText = lossText("dysco"), lossText("baseline")
		f.Note = fmt.Sprintf("rate %.0f Mbit/s found on the baseline (%d steps; carried: < %.1f %% lost and ≥ 95 %% of it received); %s", rate/1e6, len(steps), udpMaxLoss, f.Note)
		r.add(f)
	}
	return benchUDPReconfig(ctx, o, p, r, pr, rate1)
}

// h3Binary is dysco-h3, beside the dysco binary (`make build`).
func h3Binary(o *Options) string { return filepath.Join(filepath.Dir(o.Dysco), "dysco-h3") }

// h3Bytes is the size of the quic benchmark's download.
func h3Bytes(o *Options) int {
	if o.Quick {
		return 10 << 20
	}
	return 200 << 20
}

// h3Get is the JSON line of `dysco-h3 get`.
type h3Get struct {
	OK      bool    `json:"ok"`
	Bytes   int64   `json:"bytes"`
	Seconds float64 `json:"seconds"`
	Mbps    float64 `json:"mbps"`
	Error   string  `json:"error"`
}

func h3GetArgv(o *Options, server string, n int) []string {
	return []string{h3Binary(o), "get", fmt.Sprintf("https://%s:%d/bytes/%d", server, labkit.H3Port, n), "--insecure", "--timeout", "2m"}
}

// runH3Get downloads n bytes from the dysco-h3 server of v at host.
func runH3Get(ctx context.Context, o *Options, v *labkit.Variant, host string, n int) (h3Get, error) {
	out, err := labkit.Run(ctx, v.Lab, host, 3*time.Minute, h3GetArgv(o, v.Server.String(), n)...)
	var g h3Get
	if jerr := json.Unmarshal([]byte(strings.TrimSpace(out)), &g); jerr != nil {
		if err == nil {
			err = fmt.Errorf("dysco-h3 get printed no JSON: %w: %s", jerr, labkit.Tail(out, 300))
		}
		return g, err
	}
	if !g.OK || g.Bytes != int64(n) {
		return g, fmt.Errorf("dysco-h3 get in lab %s: %d of %d bytes: %s", v.Lab.Name(), g.Bytes, n, g.Error)
	}
	return g, nil
}

// startH3 starts the dysco-h3 server of both labs and waits until each
// answers (a download from the server host itself, which also makes the
// server hash the body once before the measurements).
func startH3(ctx context.Context, o *Options, p *labkit.Pair) error {
	if _, err := os.Stat(h3Binary(o)); err != nil {
		return fmt.Errorf("dysco-h3: %w (run `make build`)", err)
	}
	for _, v := range p.Both() {
		proc, err := v.Lab.Start("server", "h3", h3Binary(o), "serve", "--listen", fmt.Sprintf("%s:%d", v.Server, labkit.H3Port))
		if err != nil {
			return err
		}
		p.OnClose(func() { proc.Stop() })
		deadline := time.Now().Add(20 * time.Second)
		for {
			_, err := runH3Get(ctx, o, v, "server", h3Bytes(o))
			if err == nil {
				break
			}
			if time.Now().After(deadline) || ctx.Err() != nil {
				return fmt.Errorf("dysco-h3 server of lab %s does not answer: %w", v.Lab.Name(), err)
			}
			if err := labkit.SleepCtx(ctx, 200*time.Millisecond); err != nil {
				return err
			}
		}
	}
	return nil
}

// benchQUIC: HTTP/3 downloads (dysco-h3, hash checked) through the pair's
// middleboxes.
func benchQUIC(ctx context.Context, o *Options, p *labkit.Pair, r *Report, pr *labkit.Progress) error {
	if err := p.AddUDPPolicy(ctx); err != nil {
		return err
	}
	if err := startH3(ctx, o, p); err != nil {
		return err
	}
	n := h3Bytes(o)
	what := fmt.Sprintf("quic download of %d MB, %d mb", n>>20, p.NMB)
	ss, err := Interleaved(ctx, o, p, pr, what, func(v *labkit.Variant) (float64, string, error) {
		g, err := runH3Get(ctx, o, v, "client", n)
		if err != nil {
			return 0, "", err
		}
		return g.Mbps, "", nil
	})
	r.Details[fmt.Sprintf("quic-%dmb", p.NMB)] = ss
	if err != nil {
		return err
	}
	cmd := "ip netns exec LAB-client " + strings.Join(h3GetArgv(o, p.Dysco.Server.String(), n), " ")
	cmd = strings.Replace(cmd, h3Binary(o), "bin/dysco-h3", 1)
	f := ratioFigure(fmt.Sprintf("quic-%dmb", p.NMB), fmt.Sprintf("HTTP/3 download (%d MB), %d mb", n>>20, p.NMB), cmd, "Mbit/s", ss, 0.95, "")
	secs := func(name string) string {
		var t []float64
		for _, s := range ss {
			if s.Variant == name && s.Value > 0 {
				t = append(t, float64(n)*8/1e6/s.Value)
			}
		}
		return fmt.Sprintf("%s (%.2f s)", fmtVal(labkit.Median(Values(ss, name)), "Mbit/s"), labkit.Median(t))
	}
	f.DyscoText, f.BaselineText = secs("dysco"), secs("baseline")
	r.add(f)
	return nil
}
