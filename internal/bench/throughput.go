package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/labkit"
)

// iperfArgv is the iperf3 client command line.
func iperfArgv(server string, o *Options, streams int) []string {
	return []string{"iperf3", "-c", server, "-p", strconv.Itoa(labkit.IperfPort),
		"-t", strconv.Itoa(Secs(o.IperfTime)), "-O", "1", "-P", strconv.Itoa(streams), "-J", "--connect-timeout", "5000"}
}

// Secs is d in whole seconds, rounded up, at least 1 (the -t and -d of
// iperf3 and wrk).
func Secs(d time.Duration) int {
	s := int(math.Ceil(d.Seconds()))
	if s < 1 {
		s = 1
	}
	return s
}

// parseIperf returns the receiver's goodput in bit/s from iperf3 -J output.
func parseIperf(out string) (float64, error) {
	var r struct {
		Error string `json:"error"`
		End   struct {
			SumReceived struct {
				BitsPerSecond float64 `json:"bits_per_second"`
				Bytes         float64 `json:"bytes"`
			} `json:"sum_received"`
		} `json:"end"`
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		return 0, fmt.Errorf("iperf3 output is not JSON: %w: %s", err, labkit.Tail(out, 300))
	}
	if r.Error != "" {
		return 0, fmt.Errorf("iperf3: %s", r.Error)
	}
	if r.End.SumReceived.BitsPerSecond <= 0 {
		return 0, fmt.Errorf("iperf3 reported no goodput: %s", labkit.Tail(out, 300))
	}
	return r.End.SumReceived.BitsPerSecond, nil
}

var (
	wrkRPSRE    = regexp.MustCompile(`(?m)^Requests/sec:\s+([0-9.]+)`)
	wrkErrRE    = regexp.MustCompile(`(?m)^\s*Socket errors:.*$`)
	wrkNon2xxRE = regexp.MustCompile(`(?m)^\s*Non-2xx or 3xx responses:\s*(\d+)`)
)

// parseWrk returns requests/s and any error lines of wrk's output.
func parseWrk(out string) (float64, string, error) {
	m := wrkRPSRE.FindStringSubmatch(out)
	if m == nil {
		return 0, "", fmt.Errorf("wrk printed no Requests/sec: %s", labkit.Tail(out, 400))
	}
	rps, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		return 0, "", err
	}
	var notes []string
	if e := wrkErrRE.FindString(out); e != "" {
		notes = append(notes, strings.TrimSpace(e))
	}
	if n := wrkNon2xxRE.FindStringSubmatch(out); n != nil {
		notes = append(notes, "non-2xx responses: "+n[1])
	}
	return rps, strings.Join(notes, "; "), nil
}

// Sample is one measurement of one variant.
type Sample struct {
	Variant string            `json:"variant"`
	Rep     int               `json:"rep"`
	Value   float64           `json:"value"`
	Note    string            `json:"note,omitempty"`
	MB1     map[string]uint64 `json:"mb1_counters,omitempty"` // Dysco: mb1 counter deltas
}

// Interleaved runs measure on the Dysco and the baseline lab alternately,
// o.Reps times each, and returns the samples. For the Dysco lab it also
// records mb1's counter deltas and fails if the datapath dropped packets or
// if no packet was rewritten (the traffic did not take the chain).
func Interleaved(ctx context.Context, o *Options, p *labkit.Pair, pr *labkit.Progress, what string, measure func(v *labkit.Variant) (float64, string, error)) ([]Sample, error) {
	var out []Sample
	for rep := 1; rep <= o.Reps; rep++ {
		for _, v := range p.Both() {
			if err := ctx.Err(); err != nil {
				return out, err
			}
			pr.Logf("%s: %s, repetition %d/%d", what, v.Name, rep, o.Reps)
			var before *api.Status
			if v.Name == "dysco" {
				var err error
				if before, err = labkit.AgentStatus(ctx, o.Dysco, v.Lab, "mb1"); err != nil {
					return out, err
				}
			}
			val, note, err := measure(v)
			if err != nil {
				return out, fmt.Errorf("%s, %s lab: %w", what, v.Name, err)
			}
			s := Sample{Variant: v.Name, Rep: rep, Value: val, Note: note}
			if before != nil {
				after, err := labkit.AgentStatus(ctx, o.Dysco, v.Lab, "mb1")
				if err != nil {
					return out, err
				}
				s.MB1 = labkit.CounterDelta(before, after)
				if s.MB1["rewrite_in"] == 0 {
					return out, fmt.Errorf("%s: mb1 of the Dysco lab rewrote no packet: the traffic did not take the chain", what)
				}
				if d := labkit.Drops(s.MB1); len(d) > 0 {
					s.Note = strings.TrimPrefix(s.Note+fmt.Sprintf("; datapath drops on mb1: %v", d), "; ")
				}
			}
			pr.Logf("%s: %s, repetition %d/%d: %.4g", what, v.Name, rep, o.Reps, val)
			out = append(out, s)
		}
	}
	return out, nil
}

// Values are the values of a variant's samples, in order.
func Values(ss []Sample, variant string) []float64 {
	var v []float64
	for _, s := range ss {
		if s.Variant == variant {
			v = append(v, s.Value)
		}
	}
	return v
}

func notes(ss []Sample) string {
	seen := map[string]bool{}
	var n []string
	for _, s := range ss {
		if s.Note != "" && !seen[s.Variant+s.Note] {
			seen[s.Variant+s.Note] = true
			n = append(n, s.Variant+": "+s.Note)
		}
	}
	return strings.Join(n, "; ")
}

// pairedRatios returns Dysco/baseline of each repetition.
func pairedRatios(ss []Sample) []float64 {
	byRep := map[int][2]float64{}
	for _, s := range ss {
		v := byRep[s.Rep]
		if s.Variant == "dysco" {
			v[0] = s.Value
		} else {
			v[1] = s.Value
		}
		byRep[s.Rep] = v
	}
	var out []float64
	for rep := 1; rep <= len(byRep); rep++ {
		if v, ok := byRep[rep]; ok && v[1] > 0 {
			out = append(out, v[0]/v[1])
		}
	}
	return out
}

// ratioFigure makes a figure whose target is Dysco/baseline >= min.
func ratioFigure(key, name, cmd, unit string, ss []Sample, min float64, paper string) *Figure {
	d, b := labkit.Median(Values(ss, "dysco")), labkit.Median(Values(ss, "baseline"))
	r := labkit.Ratio(d, b)
	var rs []string
	for _, x := range pairedRatios(ss) {
		rs = append(rs, fmt.Sprintf("%.2f", x))
	}
	note := "per-repetition ratios " + strings.Join(rs, ", ")
	if n := notes(ss); n != "" {
		note += "; " + n
	}
	return &Figure{
		Key: key, Name: name, Command: cmd, Unit: unit,
		Dysco: d, Baseline: b, Ratio: r,
		Measured: r, MeasuredUnit: "× baseline",
		Target: fmt.Sprintf("≥ %.2f × baseline", min), Paper: paper,
		Met:  metStr(!math.IsNaN(r) && r >= min),
		Note: note,
	}
}

// benchGoodput: iperf3 through one middlebox, 1 and 100 sessions.
func benchGoodput(ctx context.Context, o *Options, p *labkit.Pair, r *Report, pr *labkit.Progress) error {
	details := map[string]any{}
	r.Details["goodput"] = details
	for _, streams := range []int{1, 100} {
		what := fmt.Sprintf("goodput, %d session(s), %d mb", streams, p.NMB)
		ss, err := Interleaved(ctx, o, p, pr, what, func(v *labkit.Variant) (float64, string, error) {
			argv := iperfArgv(v.Server.String(), o, streams)
			out, err := labkit.Run(ctx, v.Lab, "client", o.IperfTime+60*time.Second, argv...)
			if err != nil {
				return 0, "", err
			}
			bps, err := parseIperf(out)
			return bps / 1e9, "", err
		})
		details[fmt.Sprintf("P%d", streams)] = ss
		if err != nil {
			return err
		}
		cmd := "ip netns exec LAB-client " + strings.Join(iperfArgv(p.Dysco.Server.String(), o, streams), " ")
		f := ratioFigure(fmt.Sprintf("goodput-%dmb-P%d", p.NMB, streams),
			fmt.Sprintf("goodput, %d session%s, %d mb", streams, labkit.Plural(streams), p.NMB),
			cmd, "Gbit/s", ss, 0.98, "within 1.5%")
		r.add(f)
	}
	return nil
}

// wrkArgv is the wrk command line.
func wrkArgv(server string, o *Options) []string {
	return []string{"wrk", "-t2", "-c100", fmt.Sprintf("-d%ds", Secs(o.WrkTime)), fmt.Sprintf("http://%s:%d/%s", server, labkit.HTTPPort, labkit.SmallFile)}
}

// RPS: nginx + wrk through the pair's middleboxes.
func RPS(ctx context.Context, o *Options, p *labkit.Pair, r *Report, pr *labkit.Progress) error {
	what := fmt.Sprintf("nginx+wrk, %d mb", p.NMB)
	ss, err := Interleaved(ctx, o, p, pr, what, func(v *labkit.Variant) (float64, string, error) {
		out, err := labkit.Run(ctx, v.Lab, "client", o.WrkTime+60*time.Second, wrkArgv(v.Server.String(), o)...)
		if err != nil {
			return 0, "", err
		}
		return parseWrk(out)
	})
	r.Details[fmt.Sprintf("rps-%dmb", p.NMB)] = ss
	if err != nil {
		return err
	}
	cmd := "ip netns exec LAB-client " + strings.Join(wrkArgv(p.Dysco.Server.String(), o), " ")
	r.add(ratioFigure(fmt.Sprintf("rps-%dmb", p.NMB), fmt.Sprintf("nginx+wrk requests/s, %d mb", p.NMB), cmd, "req/s", ss, 0.98, "within 1.8%"))
	return nil
}
