package agent

import (
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
)

// TestReadForwarding: the forwarding sysctls per family, from a tree laid
// out as /proc/sys: the family's own value, then each interface's, and a
// family without sysctls (IPv6 disabled) off with nothing to name.
func TestReadForwarding(t *testing.T) {
	write := func(t *testing.T, root string, vals map[string]string) {
		for p, v := range vals {
			f := filepath.Join(root, p)
			if err := os.MkdirAll(filepath.Dir(f), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(f, []byte(v+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	ifaces := []string{"eth0", "eth1.100"}
	cases := []struct {
		name string
		vals map[string]string
		want api.Forwarding
	}{
		{"both on", map[string]string{
			"net/ipv4/ip_forward": "1", "net/ipv4/conf/eth0/forwarding": "1", "net/ipv4/conf/eth1.100/forwarding": "1",
			"net/ipv6/conf/all/forwarding": "1", "net/ipv6/conf/eth0/forwarding": "1", "net/ipv6/conf/eth1.100/forwarding": "1",
		}, api.Forwarding{IPv4: true, IPv6: true}},
		{"both off: the families' sysctls only", map[string]string{
			"net/ipv4/ip_forward": "0", "net/ipv4/conf/eth0/forwarding": "0",
			"net/ipv6/conf/all/forwarding": "0", "net/ipv6/conf/eth0/forwarding": "0",
		}, api.Forwarding{Off: []string{"net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"}}},
		{"one interface off", map[string]string{
			"net/ipv4/ip_forward": "1", "net/ipv4/conf/eth0/forwarding": "1", "net/ipv4/conf/eth1.100/forwarding": "0",
			"net/ipv6/conf/all/forwarding": "1", "net/ipv6/conf/eth0/forwarding": "0",
		}, api.Forwarding{Off: []string{"net.ipv4.conf.eth1/100.forwarding", "net.ipv6.conf.eth0.forwarding"}}},
		{"no IPv6", map[string]string{"net/ipv4/ip_forward": "1"}, api.Forwarding{IPv4: true}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			root := t.TempDir()
			write(t, root, c.vals)
			if got := readForwarding(root, ifaces); !reflect.DeepEqual(got, c.want) {
				t.Errorf("readForwarding = %+v, want %+v", got, c.want)
			}
		})
	}
}

// TestRefusalLogDue: refusals are logged at once, then at most once per
// refusalLogEvery with the count since the last line; none without new
// refusals; a counter that went down (a new datapath) counts from zero.
func TestRefusalLogDue(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	w := forwardWatch{refused: 5} // refusals before the agent started
	steps := []struct {
		at   time.Duration
		n    uint64
		want uint64
		log  bool
	}{
		{0, 5, 0, false},                              // nothing new
		{time.Second, 7, 2, true},                     // at once
		{2 * time.Second, 9, 0, false},                // within the interval
		{refusalLogEvery, 9, 0, false},                // still within it
		{refusalLogEvery + time.Second, 12, 5, true},  // the count since the last line
		{3 * refusalLogEvery, 12, 0, false},           // nothing new
		{3*refusalLogEvery + time.Second, 1, 1, true}, // counter reset
	}
	for i, s := range steps {
		got, log := w.due(t0.Add(s.at), s.n)
		if got != s.want || log != s.log {
			t.Errorf("step %d (at %v, counter %d): due = %d, %v; want %d, %v", i, s.at, s.n, got, log, s.want, s.log)
		}
	}
}
