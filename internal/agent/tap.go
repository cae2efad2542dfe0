package agent

import (
	"bufio"
	"os"
	"strconv"
	"strings"
	"time"
)

// tapPoll is how often the agent looks for captures on the session-view tap.
const tapPoll = 100 * time.Millisecond

// watchTap turns the datapath's copies to the session-view tap on while a
// packet socket (tcpdump, Snort, Zeek…) is bound to the tap or to every
// interface, and off otherwise: a copy per packet costs as much as the rest
// of the ingress path, and nobody would read it. /proc/net/packet lists the
// packet sockets of this network namespace with the interface they are
// bound to.
func (a *Agent) watchTap(ifindex int) {
	on := packetSocketOn(ifindex)
	if on == a.tapActive.Load() {
		return
	}
	if err := a.dp.SetTapActive(on); err != nil {
		a.log.Warn("session-view tap", "err", err)
		return
	}
	a.tapActive.Store(on)
	a.log.Info("session-view tap", "capturing", on)
}

// packetSocketOn tells whether a packet socket listens on ifindex (or on
// all interfaces).
func packetSocketOn(ifindex int) bool {
	f, err := os.Open("/proc/net/packet")
	if err != nil {
		return true // cannot tell: copy rather than miss packets
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Scan() // header: sk RefCnt Type Proto Iface R Rmem User Inode
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		idx, err := strconv.Atoi(fields[4])
		if err == nil && (idx == ifindex || idx == 0) {
			return true
		}
	}
	return false
}
