package main

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"sort"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/dysco/dysco/internal/migrate"
)

// direction counts one side's stream.
type direction struct {
	Bytes   uint64 `json:"bytes"`   // stream bytes sent (highest sequence seen minus the first)
	Packets uint64 `json:"packets"` // packets seen, retransmissions included
	Next    uint32 `json:"next"`    // sequence number after the highest byte seen
	Seen    bool   `json:"seen"`
}

// counter is one session's state: what moves between instances.
type counter struct {
	Fwd direction `json:"fwd"` // initiator -> responder
	Rev direction `json:"rev"`
}

// table holds the counters by session (initiator -> responder).
type table struct {
	mu sync.Mutex
	m  map[migrate.ProviderSession]*counter
}

func newTable() *table { return &table{m: map[migrate.ProviderSession]*counter{}} }

func reverse(s migrate.ProviderSession) migrate.ProviderSession {
	return migrate.ProviderSession{Src: s.Dst, Dst: s.Src, Sport: s.Dport, Dport: s.Sport, Proto: s.Proto}
}

// seqAfter is a > b in sequence space.
func seqAfter(a, b uint32) bool { return int32(a-b) > 0 }

// packet counts one TCP segment of tuple k.
func (t *table) packet(k migrate.ProviderSession, seq uint32, syn, ack bool, payload int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	c, fwd := t.m[k], true
	if c == nil {
		if c = t.m[reverse(k)]; c != nil {
			fwd = false
		}
	}
	if c == nil {
		// A new session: the SYN tells who initiated it; mid-stream
		// (an instance that got no state), guess the lower port is
		// the responder's.
		fwd = (syn && !ack) || (!syn && k.Dport < k.Sport)
		c = &counter{}
		if fwd {
			t.m[k] = c
		} else {
			t.m[reverse(k)] = c
		}
	}
	d := &c.Fwd
	if !fwd {
		d = &c.Rev
	}
	d.Packets++
	start := seq
	if syn {
		start++
	}
	end := start + uint32(payload)
	if !d.Seen {
		d.Seen, d.Next = true, start
	}
	if seqAfter(end, d.Next) {
		d.Bytes += uint64(end - d.Next)
		d.Next = end
	}
}

// handler serves the provider protocol and GET /v1/counters.
func (t *table) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/export", func(w http.ResponseWriter, r *http.Request) {
		req, ok := decode(w, r)
		if !ok {
			return
		}
		t.mu.Lock()
		c := t.m[req.Session]
		var b []byte
		if c != nil {
			b, _ = json.Marshal(c)
		}
		t.mu.Unlock()
		if c == nil {
			w.WriteHeader(http.StatusNoContent)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(b)
	})
	mux.HandleFunc("POST /v1/import", func(w http.ResponseWriter, r *http.Request) {
		req, ok := decode(w, r)
		if !ok {
			return
		}
		var c counter
		if err := json.Unmarshal(req.State, &c); err != nil {
			jsonErr(w, http.StatusBadRequest, fmt.Errorf("state: %w", err))
			return
		}
		t.mu.Lock()
		t.m[req.Session] = &c // replaces: a repeated import changes nothing more
		t.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	})
	mux.HandleFunc("POST /v1/release", func(w http.ResponseWriter, r *http.Request) {
		req, ok := decode(w, r)
		if !ok {
			return
		}
		t.mu.Lock()
		delete(t.m, req.Session)
		t.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	})
	mux.HandleFunc("GET /v1/counters", func(w http.ResponseWriter, r *http.Request) {
		type row struct {
			Session migrate.ProviderSession `json:"session"`
			counter
		}
		t.mu.Lock()
		rows := make([]row, 0, len(t.m))
		for k, c := range t.m {
			rows = append(rows, row{k, *c})
		}
		t.mu.Unlock()
		sort.Slice(rows, func(i, j int) bool {
			a, b := rows[i].Session, rows[j].Session
			if a.Src != b.Src {
				return a.Src.Less(b.Src)
			}
			return a.Sport < b.Sport
		})
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(rows)
	})
	return mux
}

func decode(w http.ResponseWriter, r *http.Request) (migrate.ProviderRequest, bool) {
	var req migrate.ProviderRequest
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16)).Decode(&req); err != nil {
		jsonErr(w, http.StatusBadRequest, err)
		return req, false
	}
	if req.Session.Proto != unix.IPPROTO_TCP {
		jsonErr(w, http.StatusBadRequest, fmt.Errorf("statecounter counts TCP sessions only, not protocol %d", req.Session.Proto))
		return req, false
	}
	req.Session.Src, req.Session.Dst = req.Session.Src.Unmap(), req.Session.Dst.Unmap()
	return req, true
}

func jsonErr(w http.ResponseWriter, code int, err error) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]string{"error": err.Error()})
}

// capture is an AF_PACKET socket on one interface, seeing every frame in
// and out.
type capture struct{ fd int }

func htons(v uint16) uint16 { return v<<8 | v>>8 }

func openCapture(iface string) (*capture, error) {
	ifi, err := net.InterfaceByName(iface)
	if err != nil {
		return nil, fmt.Errorf("interface %s: %w", iface, err)
	}
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
	if err != nil {
		return nil, fmt.Errorf("packet socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifi.Index}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("bind packet socket to %s: %w", iface, err)
	}
	return &capture{fd: fd}, nil
}

func (c *capture) Close() error { return unix.Close(c.fd) }

// run reads frames until the socket fails; GSO super-frames (up to 64 KiB
// on veth) fit the buffer.
func (c *capture) run(t *table) error {
	buf := make([]byte, 1<<18)
	for {
		n, _, err := unix.Recvfrom(c.fd, buf, 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		parseFrame(buf[:n], t)
	}
}

// parseFrame counts an Ethernet frame carrying TCP over IPv4 or IPv6
// (IPv6 without extension headers; IPv4 fragments other than the first are
// skipped).
func parseFrame(f []byte, t *table) {
	if len(f) < 14 {
		return
	}
	etype, p := binary.BigEndian.Uint16(f[12:14]), f[14:]
	if etype == 0x8100 && len(p) >= 4 { // one VLAN tag
		etype, p = binary.BigEndian.Uint16(p[2:4]), p[4:]
	}
	var src, dst netip.Addr
	var l4 []byte
	switch etype {
	case 0x0800:
		if len(p) < 20 || p[0]>>4 != 4 || p[9] != unix.IPPROTO_TCP {
			return
		}
		ihl := int(p[0]&0x0f) * 4
		tot := int(binary.BigEndian.Uint16(p[2:4]))
		if binary.BigEndian.Uint16(p[6:8])&0x1fff != 0 || ihl < 20 || len(p) < ihl {
			return
		}
		if tot >= ihl && tot < len(p) {
			p = p[:tot] // drop Ethernet padding
		}
		src, dst = netip.AddrFrom4([4]byte(p[12:16])), netip.AddrFrom4([4]byte(p[16:20]))
		l4 = p[ihl:]
	case 0x86dd:
		if len(p) < 40 || p[6] != unix.IPPROTO_TCP {
			return
		}
		if pl := int(binary.BigEndian.Uint16(p[4:6])); pl > 0 && 40+pl < len(p) {
			p = p[:40+pl]
		}
		src, dst = netip.AddrFrom16([16]byte(p[8:24])), netip.AddrFrom16([16]byte(p[24:40]))
		l4 = p[40:]
	default:
		return
	}
	if len(l4) < 20 {
		return
	}
	doff := int(l4[12]>>4) * 4
	if doff < 20 || doff > len(l4) {
		return
	}
	flags := l4[13]
	k := migrate.ProviderSession{Src: src, Dst: dst, Sport: binary.BigEndian.Uint16(l4[0:2]), Dport: binary.BigEndian.Uint16(l4[2:4]), Proto: unix.IPPROTO_TCP}
	t.packet(k, binary.BigEndian.Uint32(l4[4:8]), flags&0x02 != 0, flags&0x10 != 0, len(l4)-doff)
}
