package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"
)

// pollRemote is how often the server samples each connection's remote
// address (quic.Conn.RemoteAddr, the address of the path in use) to see
// whether the connection moved to another path.
const pollRemote = 10 * time.Millisecond

// ConnStats is what the server knows about one QUIC connection.
type ConnStats struct {
	ID int `json:"id"`
	// RemoteStart and RemoteEnd are the peer's address when the connection
	// was accepted and when it ended (or now, for a live one).
	RemoteStart string `json:"remote_start"`
	RemoteEnd   string `json:"remote_end"`
	// Remotes are the distinct peer addresses seen, in order: more than one
	// means the connection migrated (or the peer's NAT rebound it).
	Remotes  []string  `json:"remotes"`
	Migrated bool      `json:"migrated"`
	Requests int       `json:"requests"`
	Bytes    int64     `json:"bytes_sent"`
	Start    time.Time `json:"start"`
	End      time.Time `json:"end,omitzero"`
	Open     bool      `json:"open"`
	// Close is how the connection ended (quic-go's error: the client's
	// CONNECTION_CLOSE, an idle timeout, a stateless reset).
	Close string `json:"close,omitempty"`
}

// Stats is the server's report (--stats FILE).
type Stats struct {
	Listen      string       `json:"listen"`
	Connections int          `json:"connections"`
	Migrated    int          `json:"migrated"`
	Conns       []*ConnStats `json:"conns"`
}

type server struct {
	mu        sync.Mutex
	stats     Stats
	statsPath string
	// writeMu serializes writeStats: the end of a connection and a
	// signal may write at once, and two writers of one temporary file
	// would interleave their reports.
	writeMu sync.Mutex
	byConn  map[*quic.Conn]*ConnStats // live connections
	// rate paces each response body (bits per second); 0: unpaced.
	rate int64
}

type connKey struct{}

func serveMain(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	listen := fs.String("listen", "[::]:4433", "UDP `ADDR:PORT` to listen on ([::]:PORT takes IPv4 and IPv6)")
	statsPath := fs.String("stats", "", "write the per-connection report as JSON to `FILE` after each connection and on SIGTERM/SIGINT")
	certPath := fs.String("cert", "", "write the generated self-signed certificate (PEM) to `FILE`, for get --ca")
	var rate bitRate
	fs.Var(&rate, "rate", "send each response body at most at `RATE` bits per second (40M, 500k, 1G; 0: as fast as QUIC goes)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 0 {
		return fmt.Errorf("serve: unexpected arguments %q", fs.Args())
	}
	tlsConf, certPEM, err := selfSigned()
	if err != nil {
		return err
	}
	if *certPath != "" {
		if err := os.WriteFile(*certPath, certPEM, 0o644); err != nil {
			return err
		}
	}
	ln, err := quic.ListenAddr(*listen, http3.ConfigureTLSConfig(tlsConf), &quic.Config{})
	if err != nil {
		return fmt.Errorf("listen on %s: %w", *listen, err)
	}
	s := &server{statsPath: *statsPath, byConn: map[*quic.Conn]*ConnStats{}, rate: int64(rate)}
	s.stats.Listen = ln.Addr().String()
	mux := http.NewServeMux()
	mux.HandleFunc("GET /bytes/{n}", s.serveBytes)
	h3 := &http3.Server{
		Handler: mux,
		ConnContext: func(ctx context.Context, c *quic.Conn) context.Context {
			s.mu.Lock()
			defer s.mu.Unlock()
			return context.WithValue(ctx, connKey{}, s.byConn[c])
		},
	}
	if err := s.writeStats(); err != nil {
		return err
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		sig := <-sigs
		log.Printf("%v: writing stats and exiting", sig)
		if err := s.writeStats(); err != nil {
			log.Print(err)
			os.Exit(1)
		}
		os.Exit(0)
	}()
	// The ready signal for scripts and tests.
	fmt.Printf("listening on %s\n", ln.Addr())
	for {
		c, err := ln.Accept(context.Background())
		if err != nil {
			return fmt.Errorf("accept: %w", err)
		}
		cs := s.accepted(c)
		go s.watch(c, cs)
		go h3.ServeQUICConn(c)
	}
}

// accepted records a new connection.
func (s *server) accepted(c *quic.Conn) *ConnStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := c.RemoteAddr().String()
	cs := &ConnStats{ID: len(s.stats.Conns) + 1, RemoteStart: r, RemoteEnd: r, Remotes: []string{r}, Start: time.Now(), Open: true}
	s.stats.Conns = append(s.stats.Conns, cs)
	s.stats.Connections++
	s.byConn[c] = cs
	log.Printf("conn %d: accepted from %s", cs.ID, r)
	return cs
}

// watch samples the connection's remote address until it ends, then
// records how it ended.
func (s *server) watch(c *quic.Conn, cs *ConnStats) {
	t := time.NewTicker(pollRemote)
	defer t.Stop()
	done := c.Context().Done()
	for ended := false; !ended; {
		select {
		case <-t.C:
		case <-done:
			ended = true
		}
		s.seen(cs, c.RemoteAddr().String())
	}
	s.mu.Lock()
	delete(s.byConn, c)
	cs.Open = false
	cs.End = time.Now()
	if err := context.Cause(c.Context()); err != nil {
		cs.Close = err.Error()
	}
	log.Printf("conn %d: ended (%s); remote at start %s, at end %s, migrated %v, %d requests, %d bytes",
		cs.ID, cs.Close, cs.RemoteStart, cs.RemoteEnd, cs.Migrated, cs.Requests, cs.Bytes)
	s.mu.Unlock()
	if err := s.writeStats(); err != nil {
		log.Print(err)
	}
}

// seen records a remote address of a connection.
func (s *server) seen(cs *ConnStats, r string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	cs.RemoteEnd = r
	if cs.Remotes[len(cs.Remotes)-1] == r {
		return
	}
	cs.Remotes = append(cs.Remotes, r)
	if !cs.Migrated {
		cs.Migrated = true
		s.stats.Migrated++
	}
	log.Printf("conn %d: remote address changed to %s (from %s)", cs.ID, r, cs.Remotes[len(cs.Remotes)-2])
}

func (s *server) serveBytes(w http.ResponseWriter, r *http.Request) {
	n, err := parseBytesPath(r.URL.Path)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	cs, _ := r.Context().Value(connKey{}).(*ConnStats)
	w.Header().Set(hashHeader, streamHash(n))
	w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
	w.Header().Set("Content-Type", "application/octet-stream")
	sent, err := pacedCopy(w, stream(n), s.rate)
	if cs != nil {
		s.mu.Lock()
		cs.Requests++
		cs.Bytes += sent
		s.mu.Unlock()
	}
	if err != nil {
		log.Printf("GET %s from %s: after %d bytes: %v", r.URL.Path, r.RemoteAddr, sent, err)
	}
}

// writeStats writes the report atomically (a reader never sees half of it).
func (s *server) writeStats() error {
	if s.statsPath == "" {
		return nil
	}
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	s.mu.Lock()
	b, err := json.MarshalIndent(&s.stats, "", "  ")
	s.mu.Unlock()
	if err != nil {
		return err
	}
	tmp := filepath.Join(filepath.Dir(s.statsPath), "."+filepath.Base(s.statsPath)+".tmp")
	if err := os.WriteFile(tmp, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("stats: %w", err)
	}
	return os.Rename(tmp, s.statsPath)
}

// selfSigned makes a fresh ECDSA certificate for localhost and every
// address of the host's interfaces.
func selfSigned() (*tls.Config, []byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: "dysco-h3"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(30 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:     []string{"localhost"},
		IsCA:         true,

		BasicConstraintsValid: true,
	}
	if addrs, err := net.InterfaceAddrs(); err == nil {
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok {
				tmpl.IPAddresses = append(tmpl.IPAddresses, ipn.IP)
			}
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, err
	}
	cert := tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	if certPEM == nil {
		return nil, nil, errors.New("encoding the certificate")
	}
	return &tls.Config{Certificates: []tls.Certificate{cert}}, certPEM, nil
}

// bitRate is a rate in bits per second, written as a number with an
// optional decimal suffix k, M or G (as iperf3's -b).
type bitRate int64

func (r *bitRate) String() string { return strconv.FormatInt(int64(*r), 10) }

func (r *bitRate) Set(v string) error {
	n, err := parseBitRate(v)
	if err != nil {
		return err
	}
	*r = bitRate(n)
	return nil
}

// parseBitRate reads "40M" (40,000,000), "500k", "1G" or a plain number
// of bits per second.
func parseBitRate(v string) (int64, error) {
	mult := int64(1)
	num := v
	if v != "" {
		switch v[len(v)-1] {
		case 'k', 'K':
			mult, num = 1e3, v[:len(v)-1]
		case 'm', 'M':
			mult, num = 1e6, v[:len(v)-1]
		case 'g', 'G':
			mult, num = 1e9, v[:len(v)-1]
		}
	}
	f, err := strconv.ParseFloat(num, 64)
	if err != nil || f < 0 || f*float64(mult) > 1e12 {
		return 0, fmt.Errorf("rate %q: want bits per second, like 40M, 500k or 1G", v)
	}
	return int64(f * float64(mult)), nil
}

// paceChunk is how much pacedCopy writes at a time; paceBurst how far
// behind its schedule a paced body may fall and still catch up at full
// speed.
const (
	paceChunk = 16 << 10
	paceBurst = 10 * time.Millisecond
)

// pacedCopy copies src to w no faster than rate bits per second (0:
// unpaced), in chunks of paceChunk, each written when the time the bytes
// before it take at the rate has passed. A body held back below the rate
// (a slow path, flow control) does not make up for it with a burst later:
// its schedule never lags the clock by more than paceBurst.
func pacedCopy(w io.Writer, src io.Reader, rate int64) (int64, error) {
	if rate <= 0 {
		return io.Copy(w, src)
	}
	buf := make([]byte, paceChunk)
	next := time.Now()
	var sent int64
	for {
		if d := time.Until(next); d > 0 {
			time.Sleep(d)
		}
		n, rerr := src.Read(buf)
		if n > 0 {
			m, werr := w.Write(buf[:n])
			sent += int64(m)
			if werr != nil {
				return sent, werr
			}
			if floor := time.Now().Add(-paceBurst); next.Before(floor) {
				next = floor
			}
			next = next.Add(time.Duration(float64(m) * 8 / float64(rate) * float64(time.Second)))
		}
		if rerr == io.EOF {
			return sent, nil
		}
		if rerr != nil {
			return sent, rerr
		}
	}
}
