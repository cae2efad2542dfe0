package e2e

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/lab"
	"github.com/dysco/dysco/internal/testutil"
)

// iperfUDPReport is what the UDP tests read of iperf3 -u -J's report.
type iperfUDPReport struct {
	End struct {
		Sum struct {
			Bytes       int64   `json:"bytes"`
			Packets     int64   `json:"packets"`
			LostPackets int64   `json:"lost_packets"`
			LostPercent float64 `json:"lost_percent"`
		} `json:"sum"`
	} `json:"end"`
	Error string `json:"error"`
}

// parseIperfUDP reads iperf3 -u -J's report; an error if it has none or
// says iperf3 failed.
func parseIperfUDP(out string) (iperfUDPReport, error) {
	var r iperfUDPReport
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		return r, fmt.Errorf("no report: %w", err)
	}
	if r.Error != "" {
		return r, errors.New(r.Error)
	}
	return r, nil
}

// TestUDPReconfigure: a live iperf3 -u stream, both directions, has its
// middleboxes replaced, deleted and inserted (docs/protocol.md, "UDP
// sessions"): every reconfiguration succeeds, no datagram is lost, and the
// anchors drop nothing; the session's tuple never changes for the ends.
func TestUDPReconfigure(t *testing.T) {
	testutil.RequireTools(t, "iperf3")
	e := newLab(t, labOpts{topology: lab.Star("client", "mb1", "mb2", "server"), prefix: "ur"})
	for _, v6 := range []bool{false, true} {
		t.Run(fmt.Sprintf("ipv6=%v", v6), func(t *testing.T) {
			e := e.withT(t)
			dst, mb1, mb2 := e.addr("server", v6), e.addr("mb1", v6), e.addr("mb2", v6)
			fam, port := "ip", iperfPort
			if v6 {
				fam, port = "ip6", iperfPort+1
			}
			e.policy("client", "udp-"+fam, fmt.Sprintf("%s and udp dst port %d", fam, port), mb1.String())
			for _, reverse := range []bool{false, true} {
				p := e.iperfServerOnce("server", port, fmt.Sprintf("iperf3ur-%v-%v", v6, reverse))
				args := []string{"iperf3", "-J", "-u", "-b", "50M", "-l", "1200", "-w", "4M", "-t", "6", "-c", dst.String(), "-p", fmt.Sprint(port)}
				if reverse {
					args = append(args, "-R")
				}
				drops := func() uint64 {
					var n uint64
					for _, h := range []string{"client", "server"} {
						for k, v := range e.status(h).Counters {
							if strings.HasPrefix(k, "drop_") {
								n += v
							}
						}
					}
					return n
				}
				before := drops()
				icmp := e.capture("client", e.host("client").Iface, "icmp or icmp6", "-v")
				done := make(chan string, 1)
				go func() {
					out, _ := e.lab.Command(t.Context(), "client", args...).Output()
					done <- string(out)
				}()
				match := fmt.Sprintf("%s and udp dst port %d", fam, port)
				testutil.Eventually(t, 10*time.Second, "the UDP session to be answered at the client", func() bool {
					for _, s := range e.sessions("client") {
						if s.Proto == "udp" && s.State == "established" && strings.HasSuffix(s.Session, fmt.Sprintf(":%d", port)) {
							return true
						}
					}
					return false
				})
				for _, step := range []struct {
					what  string
					chain []string
				}{{"replace mb1 by mb2", []string{mb2.String()}}, {"delete mb2", nil}, {"insert mb1", []string{mb1.String()}}} {
					args := []string{dyscoBin, "reconfig", "--json", "--timeout", "30s", "--match", match, "--to", dst.String()}
					if len(step.chain) > 0 {
						args = append(args, "--chain", strings.Join(step.chain, ","))
					}
					out, err := e.lab.Command(t.Context(), "client", args...).Output()
					var rep struct {
						Results []struct {
							Outcome, Reason string
							Micros          int64 `json:"micros"`
						} `json:"results"`
					}
					// The earlier run's session may still be there
					// (idle, not yet timed out): it moves too.
					if jerr := json.Unmarshal(out, &rep); jerr != nil || len(rep.Results) == 0 {
						t.Fatalf("%s: %v %v\n%s", step.what, err, jerr, out)
					}
					for _, r := range rep.Results {
						if r.Outcome != "succeeded" {
							t.Fatalf("%s: %s %s\n%s", step.what, r.Outcome, r.Reason, out)
						}
					}
					t.Logf("%s: %d sessions, %.1f ms", step.what, len(rep.Results), float64(rep.Results[0].Micros)/1000)
				}
				out := <-done
				lines := icmp()
				r, err := parseIperfUDP(out)
				if err != nil {
					t.Fatalf("iperf3 -u: %v\n%s\nICMP at the client:\n%s", err, out, strings.Join(lines, "\n"))
				}
				s := r.End.Sum
				t.Logf("iperf3 -u reverse=%v: %d packets, %d lost", reverse, s.Packets, s.LostPackets)
				if s.LostPackets != 0 || s.Packets == 0 {
					t.Errorf("iperf3 -u reverse=%v: %d of %d datagrams lost across three reconfigurations", reverse, s.LostPackets, s.Packets)
				}
				if d := drops() - before; d != 0 {
					t.Errorf("the anchors dropped %d packets", d)
				}
				select {
				case <-p.Done():
				case <-time.After(30 * time.Second):
					t.Fatal("the one-off iperf3 server did not exit")
				}
			}
		})
	}
}
