package reconfig

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/protocol"
)

// A trigger's migration spec comes from a peer: its hold limit and timeout
// are clamped to the protocol's maxima. An operator's request beyond them
// is refused, naming the bound; the API and the protocol agree on them.
func TestMigrateBoundsClamped(t *testing.T) {
	o := migrateOptions(&protocol.MigrateSpec{Semantics: protocol.MigrateOrder, HoldLimit: 1 << 62, TimeoutMS: math.MaxUint32})
	if o.HoldLimit != protocol.MaxHoldLimit || o.Timeout != protocol.MaxMigTimeout || o.Semantics != SemOrder {
		t.Errorf("trigger's spec taken as %+v, want hold %d, timeout %v", o, protocol.MaxHoldLimit, protocol.MaxMigTimeout)
	}
	if o := migrateOptions(&protocol.MigrateSpec{}); o.HoldLimit != DefaultHoldLimit || o.Timeout != defaultMigTimeout {
		t.Errorf("empty spec taken as %+v, want the defaults", o)
	}

	if api.MaxHoldLimit != protocol.MaxHoldLimit || time.Duration(api.MaxMigrateTimeoutMS)*time.Millisecond != protocol.MaxMigTimeout {
		t.Errorf("api maxima %d, %d ms differ from the protocol's %d, %v", api.MaxHoldLimit, api.MaxMigrateTimeoutMS,
			protocol.MaxHoldLimit, protocol.MaxMigTimeout)
	}
	for _, c := range []struct {
		spec api.MigrateSpec
		want string
	}{
		{api.MigrateSpec{HoldLimit: api.MaxHoldLimit + 1}, "hold_limit 268435457: want 0 (8 MiB) to 268435456"},
		{api.MigrateSpec{HoldLimit: -1}, "hold_limit -1"},
		{api.MigrateSpec{TimeoutMS: api.MaxMigrateTimeoutMS + 1}, "timeout_ms 300001: want 0 (5 s) to 300000"},
	} {
		if _, err := ParseMigrate(&c.spec, 1); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("ParseMigrate(%+v): %v, want %q", c.spec, err, c.want)
		}
	}
	if o, err := ParseMigrate(&api.MigrateSpec{HoldLimit: api.MaxHoldLimit, TimeoutMS: api.MaxMigrateTimeoutMS}, 1); err != nil ||
		o.HoldLimit != api.MaxHoldLimit || o.Timeout != protocol.MaxMigTimeout {
		t.Errorf("the maxima themselves: %+v %v", o, err)
	}
}
