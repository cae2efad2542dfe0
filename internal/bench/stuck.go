package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/labkit"
)

// StuckSession is one session of which a direction did not reach EOF: the
// addresses that name it on each host (client side, server side).
type StuckSession struct {
	What      string   // "session 12 (10.200.1.2:40000) up: ..."
	Addresses []string // "ip:port" of the session's sockets, as the hosts see them
}

// maxStuckDumped bounds the sessions a dump describes in full.
const maxStuckDumped = 20

// DumpStuck writes what every host of a lab knows of sessions that did not
// finish: each agent's records of them (`dysco sessions -o json`: the
// subsessions, the reconfiguration state, the two-path record of §3.5), its
// counters (drops by reason), and the kernel's TCP state of their sockets
// (`ss -tinmeo`: windows, retransmissions, memory). It goes to stuck.log in
// the lab's run directory, which a failed run keeps with the other logs
// (`dysco lab run` copies it to OUT/logs/LAB/). It returns the file's path.
func DumpStuck(ctx context.Context, o *Options, rl *ReconfigLab, stuck []StuckSession) (string, error) {
	path := filepath.Join(rl.Lab.RunDir(), "stuck.log")
	f, err := os.Create(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	fmt.Fprintf(f, "%s: %d session directions did not finish; the first %d in full\n", time.Now().UTC().Format(time.RFC3339), len(stuck), min(len(stuck), maxStuckDumped))
	if m, p, err := labkit.TCPMemPages(); err == nil {
		fmt.Fprintf(f, "TCP memory of the machine: %d pages in use, pressure threshold %d (net.ipv4.tcp_mem)\n", m, p)
	}
	fmt.Fprintln(f)
	stuck = stuck[:min(len(stuck), maxStuckDumped)]
	match := func(s string) bool {
		for _, st := range stuck {
			for _, a := range st.Addresses {
				if containsAddr(s, a) {
					return true
				}
			}
		}
		return false
	}
	for _, st := range stuck {
		fmt.Fprintf(f, "%s\n  addresses %s\n", st.What, strings.Join(st.Addresses, ", "))
	}
	for _, host := range []string{"client", "proxy", "server"} {
		fmt.Fprintf(f, "\n=== %s: dysco sessions (records naming these addresses)\n", host)
		if out, err := labkit.DyscoCLI(ctx, o.Dysco, rl.Lab, host, "sessions", "-o", "json"); err != nil {
			fmt.Fprintf(f, "error: %v\n", err)
		} else {
			var sess []api.Session
			if err := json.Unmarshal([]byte(out), &sess); err != nil {
				fmt.Fprintf(f, "error: %v\n", err)
			}
			for _, s := range sess {
				if match(s.Session) || match(s.Left) || match(s.Right) {
					b, _ := json.MarshalIndent(s, "", "  ")
					fmt.Fprintf(f, "%s\n", b)
				}
			}
		}
		fmt.Fprintf(f, "\n=== %s: dysco status counters\n", host)
		if st, err := labkit.AgentStatus(ctx, o.Dysco, rl.Lab, host); err != nil {
			fmt.Fprintf(f, "error: %v\n", err)
		} else {
			b, _ := json.MarshalIndent(st.Counters, "", "  ")
			fmt.Fprintf(f, "%s\n", b)
		}
		fmt.Fprintf(f, "\n=== %s: nstat (TCP drops and memory pressure since the namespace began)\n", host)
		if out, err := labkit.Run(ctx, rl.Lab, host, 30*time.Second, "nstat", "-asz"); err != nil {
			fmt.Fprintf(f, "error: %v\n", err)
		} else {
			for _, line := range strings.Split(out, "\n") {
				if f0 := strings.Fields(line); len(f0) >= 2 && f0[1] != "0" && nstatWanted(f0[0]) {
					fmt.Fprintln(f, line)
				}
			}
		}
		fmt.Fprintf(f, "\n=== %s: ss -tinmeo (sockets of these sessions)\n", host)
		out, err := labkit.Run(ctx, rl.Lab, host, 30*time.Second, "ss", "-tinmeoHa")
		if err != nil {
			fmt.Fprintf(f, "error: %v\n", err)
			continue
		}
		// ss prints a socket on one line and its details on the next.
		lines := strings.Split(out, "\n")
		for i := 0; i < len(lines); i++ {
			if match(lines[i]) {
				fmt.Fprintln(f, lines[i])
				if i+1 < len(lines) && strings.HasPrefix(lines[i+1], "\t") {
					fmt.Fprintln(f, lines[i+1])
					i++
				}
			}
		}
	}
	return path, nil
}

// nstatWanted picks the counters that tell why a TCP stream stalls.
func nstatWanted(name string) bool {
	for _, k := range []string{"Drop", "Prune", "Pressure", "Retrans", "Timeout", "Collapse", "Loss", "ZeroWindow", "WantZeroWindow", "OldAck", "TooOld", "Probe", "Abort", "Rst", "Reset", "PAWS"} {
		if strings.Contains(name, k) {
			return true
		}
	}
	return false
}

// containsAddr tells whether s names the address "ip:port" a, not merely a
// longer port that starts with the same digits.
func containsAddr(s, a string) bool {
	for i := 0; ; {
		j := strings.Index(s[i:], a)
		if j < 0 {
			return false
		}
		end := i + j + len(a)
		if end == len(s) || s[end] < '0' || s[end] > '9' {
			return true
		}
		i = end
	}
}
