package api

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"
)

func addrs(ss ...string) []netip.Addr {
	var as []netip.Addr
	for _, s := range ss {
		as = append(as, netip.MustParseAddr(s))
	}
	return as
}

func TestCheckPath(t *testing.T) {
	for _, tc := range []struct {
		to    string
		chain []string
		want  string // "" for none
	}{
		{"10.0.3.2", nil, ""},
		{"10.0.3.2", []string{"10.0.2.5", "::ffff:10.0.2.6"}, ""},
		{"2001:db8::3", []string{"2001:db8::5"}, ""},
		{"0.0.0.0", nil, "the right anchor 0.0.0.0 is not a unicast address"},
		{"ff02::1", nil, "the right anchor ff02::1 is not a unicast address"},
		{"10.0.3.2", []string{"127.0.0.1"}, "hop 127.0.0.1 is not a unicast address"},
		{"10.0.3.2", []string{"10.0.2.5", "255.255.255.255"}, "hop 255.255.255.255 is not a unicast address"},
		{"10.0.3.2", []string{"::ffff:10.0.3.2"}, "the right anchor 10.0.3.2 is in the chain"},
		{"10.0.3.2", []string{"10.0.2.5", "10.0.2.6", "::ffff:10.0.2.5"}, "hop 10.0.2.5 appears twice"},
		{"10.0.3.2", []string{"2001:db8::5"}, "hop 2001:db8::5 and the right anchor 10.0.3.2 are of different address families"},
		{"10.0.3.2", []string{"10.0.2.1", "10.0.2.2", "10.0.2.3", "10.0.2.4", "10.0.2.5", "10.0.2.6", "10.0.2.7", "10.0.2.8"}, "8 hops, at most 7"},
	} {
		err := CheckPath(netip.MustParseAddr(tc.to), addrs(tc.chain...))
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("CheckPath(%s, %v) = %v, want %q", tc.to, tc.chain, err, tc.want)
		}
	}
	if err := CheckPath(netip.Addr{}, nil); err == nil || !strings.Contains(err.Error(), "no right anchor") {
		t.Errorf("no anchor: %v", err)
	}
}

func TestPolicyAndTypeValidate(t *testing.T) {
	hop := func(s string) Hop { h, _ := ParseHop(s); return h }
	for _, tc := range []struct {
		p    Policy
		want string
	}{
		{Policy{Name: "web", Filter: "tcp", Chain: []Hop{hop("10.0.0.5"), hop("fw")}}, ""},
		{Policy{Name: "web", Filter: "tcp", Chain: []Hop{hop("0.0.0.0")}}, `hop 0.0.0.0 is not a unicast address`},
		{Policy{Name: "web", Filter: "tcp", Chain: []Hop{hop("224.0.0.9")}}, `hop 224.0.0.9 is not a unicast address`},
		{Policy{Name: "web", Filter: "tcp", Chain: []Hop{hop("::1")}}, `hop ::1 is not a unicast address`},
		{Policy{Name: "web", Filter: "tcp", Chain: []Hop{hop("10.0.0.5"), hop("10.0.0.5")}}, "appears twice"},
		{Policy{Name: "quic", Filter: "udp", IdleTimeoutS: 1}, ""},
		{Policy{Name: "quic", Filter: "udp", IdleTimeoutS: 64800}, ""},
		{Policy{Name: "quic", Filter: "udp", IdleTimeoutS: 64801}, `idle timeout of 64801 s: want 0 (the defaults, 30s one way, 2m0s both ways) or 1s to 18h0m0s`},
		{Policy{Name: "quic", Filter: "udp", IdleTimeoutS: -1}, `idle timeout of -1 s`},
		{Policy{Name: "quic", Filter: "udp", IdleTimeoutS: 1 << 62}, `idle timeout of`},
		{Policy{Name: "multi", Filter: "tcp", Via: []netip.Addr{netip.MustParseAddr("10.0.1.5"), netip.MustParseAddr("10.0.2.5"), netip.MustParseAddr("10.0.2.5"), netip.MustParseAddr("fd00::5")}}, ""},
		{Policy{Name: "multi", Filter: "tcp", Via: []netip.Addr{netip.MustParseAddr("127.0.0.1")}}, `via 127.0.0.1 is not a unicast address`},
		{Policy{Name: "multi", Filter: "tcp", Via: []netip.Addr{{}}}, `is not a unicast address`},
		{Policy{Name: "multi", Filter: "tcp", Via: slices.Repeat([]netip.Addr{netip.MustParseAddr("10.0.1.5")}, MaxVia+1)}, `more than 8 via addresses of one family`},
		{Policy{Name: "multi", Filter: "tcp", Via: append(slices.Repeat([]netip.Addr{netip.MustParseAddr("10.0.1.5")}, MaxVia), netip.MustParseAddr("fd00::5"))}, ""},
	} {
		err := tc.p.Validate()
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%v: %v, want %q", tc.p.Chain, err, tc.want)
		}
	}
	many := make([]string, MaxInstances+1)
	for i := range many {
		many[i] = fmt.Sprintf("10.0.0.%d", i+1)
	}
	for _, tc := range []struct {
		inst []string
		want string
	}{
		{[]string{"10.0.0.5", "2001:db8::5"}, ""},
		{many[:MaxInstances], ""},
		{many, "17 instances, at most 16"},
		{[]string{"10.0.0.5", "::ffff:10.0.0.5"}, "instance ::ffff:10.0.0.5 appears twice"},
		{[]string{"239.0.0.1"}, "instance 239.0.0.1 is not a unicast address"},
		{[]string{"::"}, "instance :: is not a unicast address"},
	} {
		ty := MiddleboxType{Name: "nat", Instances: addrs(tc.inst...)}
		err := ty.Validate()
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("type %v: %v, want %q", tc.inst, err, tc.want)
		}
	}
}

// An operation's migration spec is bounded like a local request's.
func TestOperationMigrateBounds(t *testing.T) {
	to := netip.MustParseAddr("10.0.0.3")
	for _, op := range []Operation{
		{Host: "h1", Reconfig: &ReconfigRequest{To: to, Migrate: &MigrateSpec{HoldLimit: MaxHoldLimit + 1}}},
		{Host: "h1", Middlebox: &MiddleboxRequest{Migrate: &MigrateSpec{TimeoutMS: MaxMigrateTimeoutMS + 1}}},
	} {
		if err := op.Validate(); err == nil || !strings.Contains(err.Error(), "operation: migrate:") {
			t.Errorf("%+v: %v", op, err)
		}
	}
	ok := Operation{Host: "h1", Reconfig: &ReconfigRequest{To: to, Migrate: &MigrateSpec{HoldLimit: MaxHoldLimit, TimeoutMS: MaxMigrateTimeoutMS}}}
	if err := ok.Validate(); err != nil {
		t.Errorf("the maxima: %v", err)
	}
}

func TestPolicyIdleTimeoutJSON(t *testing.T) {
	var p Policy
	// A policy stored before the field existed uses the defaults.
	if err := json.Unmarshal([]byte(`{"name":"web","filter":"tcp"}`), &p); err != nil || p.IdleTimeout() != 0 {
		t.Fatalf("old policy: %+v, %v", p, err)
	}
	p.IdleTimeoutS = 600
	b, err := json.Marshal(p)
	if err != nil || !strings.Contains(string(b), `"idle_timeout_s":600`) {
		t.Fatalf("Marshal = %s, %v", b, err)
	}
	var q Policy
	if err := json.Unmarshal(b, &q); err != nil || q.IdleTimeout() != 10*time.Minute {
		t.Fatalf("round trip: %+v, %v", q, err)
	}
}
