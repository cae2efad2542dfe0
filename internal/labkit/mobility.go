package labkit

// Break-before-make moves in a lab (docs/mobility.md): a star host with
// two links and session addresses loses the IPv4 address of one link
// (with its default route, as when a DHCP lease ends), its agent rebinds
// its sessions from the other link, and the address comes back.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/netip"
	"sort"
	"strings"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/lab"
)

// LinkMover takes a lab host's link addresses away and gives them back.
type LinkMover struct {
	l     *lab.Lab
	host  string
	dysco string
	links [2]struct {
		iface   string
		pfx     netip.Prefix
		restore [][]string
	}
}

// NewLinkMover returns the mover of host, which must have two links and
// session addresses; dysco is the CLI's binary.
func NewLinkMover(l *lab.Lab, host, dysco string) (*LinkMover, error) {
	h := l.Host(host)
	if h == nil || !h.SessionAddr4.IsValid() || len(h.Ifaces) < 2 {
		return nil, fmt.Errorf("%s has no session address or no second link", host)
	}
	m := &LinkMover{l: l, host: host, dysco: dysco}
	for k := range 2 {
		ifc := h.Ifaces[k]
		lk := &m.links[k]
		lk.iface, lk.pfx = ifc.Name, ifc.Addr4
		lk.restore = [][]string{{"addr", "add", ifc.Addr4.String(), "dev", ifc.Name}}
		for _, rt := range h.Routes {
			if rt.Iface != ifc.Name || !rt.Dst.Addr().Is4() {
				continue
			}
			cmd := []string{"route", "replace", "default", "via", rt.Via.String(), "dev", ifc.Name}
			if rt.Metric != 0 {
				cmd = append(cmd, "metric", fmt.Sprint(rt.Metric))
			}
			if rt.Table != 0 {
				cmd = append(cmd, "table", fmt.Sprint(rt.Table))
			}
			if rt.Src.IsValid() {
				cmd = append(cmd, "src", rt.Src.String())
			}
			lk.restore = append(lk.restore, cmd)
		}
	}
	return m, nil
}

// Addr is link k's IPv4 address.
func (m *LinkMover) Addr(k int) netip.Addr { return m.links[k].pfx.Addr() }

func (m *LinkMover) ip(ctx context.Context, args ...string) error {
	_, err := Run(ctx, m.l, m.host, 10*time.Second, append([]string{"ip", "-4"}, args...)...)
	return err
}

// Drop deletes link k's address and its default route in the main table.
func (m *LinkMover) Drop(ctx context.Context, k int) error {
	lk := m.links[k]
	if err := m.ip(ctx, "addr", "del", lk.pfx.String(), "dev", lk.iface); err != nil {
		return err
	}
	_ = m.ip(ctx, "route", "del", "default", "dev", lk.iface) // gone with the address, or not
	return nil
}

// Restore gives link k its address and routes back.
func (m *LinkMover) Restore(ctx context.Context, k int) error {
	for _, cmd := range m.links[k].restore {
		if err := m.ip(ctx, cmd...); err != nil {
			return err
		}
	}
	return nil
}

// LeavesFrom returns the address the first subsession of the host's
// established session to port leaves from, or no address.
func (m *LinkMover) LeavesFrom(ctx context.Context, port int) netip.Addr {
	out, err := DyscoCLI(ctx, m.dysco, m.l, m.host, "sessions", "-o", "json")
	if err != nil {
		return netip.Addr{}
	}
	var ss []api.Session
	if json.Unmarshal([]byte(out), &ss) != nil {
		return netip.Addr{}
	}
	for _, s := range ss {
		if s.Role != "start" || s.State != "established" || !strings.HasSuffix(s.Session, fmt.Sprintf(":%d", port)) {
			continue
		}
		if f := strings.Fields(s.Right); len(f) > 0 {
			if ap, err := netip.ParseAddrPort(f[0]); err == nil {
				return ap.Addr()
			}
		}
	}
	return netip.Addr{}
}

// Move drops link k's address and waits until the session to port
// leaves from link 1-k's, polling every 10 ms for up to limit. It returns
// when the address went and when the move was seen (zero if it was not).
func (m *LinkMover) Move(ctx context.Context, k, port int, limit time.Duration) (start, moved time.Time, err error) {
	start = time.Now()
	if err := m.Drop(ctx, k); err != nil {
		return start, time.Time{}, err
	}
	to := m.Addr(1 - k)
	for time.Since(start) < limit && ctx.Err() == nil {
		if m.LeavesFrom(ctx, port) == to {
			return start, time.Now(), nil
		}
		_ = SleepCtx(ctx, 10*time.Millisecond)
	}
	return start, time.Time{}, ctx.Err()
}

// PacedWrite writes to c at rate bits a second, in writes of chunk bytes,
// until ctx ends (then it returns ctx's error) or a write fails.
func PacedWrite(ctx context.Context, c io.Writer, rate float64, chunk int) error {
	buf := make([]byte, chunk)
	every := time.Duration(float64(chunk*8) / rate * float64(time.Second))
	next := time.Now()
	for ctx.Err() == nil {
		if _, err := c.Write(buf); err != nil {
			return err
		}
		next = next.Add(every)
		if d := time.Until(next); d > 0 {
			time.Sleep(d)
		}
	}
	return ctx.Err()
}

// ConntrackOrig returns the original tuples (src= dst= sport= dport=) of
// the lines of `conntrack -L`, sorted.
func ConntrackOrig(out string) []string {
	var got []string
	for _, line := range strings.Split(out, "\n") {
		var tup []string
		for _, f := range strings.Fields(line) {
			if strings.HasPrefix(f, "src=") || strings.HasPrefix(f, "dst=") || strings.HasPrefix(f, "sport=") || strings.HasPrefix(f, "dport=") {
				if tup = append(tup, f); len(tup) == 4 {
					break
				}
			}
		}
		if len(tup) == 4 {
			got = append(got, strings.Join(tup, " "))
		}
	}
	sort.Strings(got)
	return got
}
