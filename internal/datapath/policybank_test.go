package datapath

import (
	"net/netip"
	"reflect"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/dysco/dysco/internal/api"
	"github.com/dysco/dysco/internal/policy"
)

// TestInstallPoliciesAllOrNothing: a policy set goes in whole or not at all.
// A set whose classifier the kernel refuses leaves the classifier in force
// and its bank (chains and types) untouched, and new sessions still take the
// old chain; the next set that loads takes over, in the other bank.
func TestInstallPoliciesAllOrNothing(t *testing.T) {
	fx := newFixture(t)
	if fx.d.PoliciesPerBank() != api.MaxPolicies || fx.d.TypesPerBank() != api.MaxTypes || api.MaxPolicies != policy.MaxPolicies {
		t.Fatalf("a bank holds %d policies and %d types; the API says %d and %d, the classifier %d",
			fx.d.PoliciesPerBank(), fx.d.TypesPerBank(), api.MaxPolicies, api.MaxTypes, policy.MaxPolicies)
	}
	web, err := policy.Compile(api.Policy{Name: "web", Filter: "tcp dst port 80"})
	if err != nil {
		t.Fatal(err)
	}
	build := func(base int) (*ebpf.ProgramSpec, error) {
		return policy.BuildProgram([]policy.Compiled{web}, fx.d.ProgArray(), base)
	}
	load := func(base int) (*ebpf.Program, error) {
		spec, err := build(base)
		if err != nil {
			return nil, err
		}
		p, err := ebpf.NewProgram(spec)
		if err == nil {
			t.Cleanup(func() { p.Close() })
		}
		return p, err
	}
	// The web policy: through one instance of type 0, then the destination.
	chains := []PolicyChain{{Hops: []PolicyHop{{Type: 0}}, ToDst: true}}
	firstHop := func(port uint16) netip.Addr {
		t.Helper()
		syn := pkt{seq: 1, flags: "S", win: 64240, opts: synOpts()}.with(tup(apOf(hostV4, port), apOf(serverV4, 80)))
		verdict, out := fx.run(t, fx.egress, syn.frame(t))
		if verdict != tcActRedirect {
			t.Fatalf("SYN from port %d: verdict %d, want %d (chained)", port, verdict, tcActRedirect)
		}
		v, _ := decode(t, out)
		return v.Dst.Addr()
	}
	bankEntries := func(bank int) ([]dyscoPolicyVal, []dyscoTypeVal) {
		t.Helper()
		np, nt := fx.d.PoliciesPerBank(), fx.d.TypesPerBank()
		pols, types := make([]dyscoPolicyVal, np), make([]dyscoTypeVal, nt)
		for i := range pols {
			if err := fx.d.objs.DyscoPolicies.Lookup(uint32(bank*np+i), &pols[i]); err != nil {
				t.Fatal(err)
			}
		}
		for i := range types {
			if err := fx.d.objs.DyscoTypes.Lookup(uint32(bank*nt+i), &types[i]); err != nil {
				t.Fatal(err)
			}
		}
		return pols, types
	}

	if _, err := fx.d.InstallPolicies([][]netip.Addr{{mboxV4}}, chains, load); err != nil {
		t.Fatal(err)
	}
	bankA, err := fx.d.PolicyBank()
	if err != nil {
		t.Fatal(err)
	}
	if got := firstHop(40001); got != mboxV4 {
		t.Fatalf("first set: first hop %v, want %v", got, mboxV4)
	}
	polsA, typesA := bankEntries(bankA)

	// The next set (type 0 now mbox2V4) builds a classifier that the
	// kernel refuses: its last instruction, the exit, is cut off.
	_, err = fx.d.InstallPolicies([][]netip.Addr{{mbox2V4}}, chains, func(base int) (*ebpf.Program, error) {
		spec, err := build(base)
		if err != nil {
			return nil, err
		}
		spec.Instructions = spec.Instructions[:len(spec.Instructions)-1]
		return ebpf.NewProgram(spec)
	})
	if err == nil {
		t.Fatal("a classifier without its exit was loaded")
	}
	t.Logf("refused as expected: %v", err)
	if b, _ := fx.d.PolicyBank(); b != bankA {
		t.Errorf("a failed set moved the bank in force from %d to %d", bankA, b)
	}
	if pols, types := bankEntries(bankA); !reflect.DeepEqual(pols, polsA) || !reflect.DeepEqual(types, typesA) {
		t.Errorf("a failed set changed the bank in force")
	}
	if got := firstHop(40002); got != mboxV4 {
		t.Fatalf("after a failed set: first hop %v, want the old chain's %v", got, mboxV4)
	}

	// The same set with a classifier that loads takes over.
	if _, err := fx.d.InstallPolicies([][]netip.Addr{{mbox2V4}}, chains, load); err != nil {
		t.Fatal(err)
	}
	if b, _ := fx.d.PolicyBank(); b == bankA {
		t.Errorf("the new set was written into the bank in force (%d)", b)
	}
	if got := firstHop(40003); got != mbox2V4 {
		t.Fatalf("second set: first hop %v, want %v", got, mbox2V4)
	}

	// A chain naming a type the set does not have is refused before
	// anything changes.
	if _, err := fx.d.InstallPolicies(nil, chains, load); err == nil {
		t.Error("a chain naming a missing type was installed")
	}
	if got := firstHop(40004); got != mbox2V4 {
		t.Fatalf("after a refused set: first hop %v, want %v", got, mbox2V4)
	}
}
