// Package reconfig is the agent's half of dynamic reconfiguration (paper §3, §4.1 "Daemon"): a
// UDP socket for control messages, timers, and the translation between the
// protocol core (internal/protocol, a pure state machine) and the datapath's
// maps. The control state is serialised by one mutex (Shell.mu): the
// goroutine that reads the control socket handles what it read itself,
// holding it, and so does the one that reads the datapath's events; work from
// elsewhere (the API, timers, the collector) is posted as closures to the
// loop goroutine, which runs them holding it too.
//
// What the loop sends for one item (a datagram read, a side's progress
// from the datapath's ring, a posted closure) goes out when the item has
// been handled, several messages for the same agent as one bundle
// (protocol.PackBundles; docs/protocol.md, "Bundles"): a datagram carried
// through the network stack once for several messages, and no item's
// messages waiting for another item's handling.
//
// The shell depends on the datapath through the Datapath interface,
// grouped by map, so that its tests run against a fake (fake_test.go)
// without root.
package reconfig
