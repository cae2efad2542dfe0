package policyserver

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dysco/dysco/internal/api"
)

// A middlebox type that a policy names cannot be deleted: the answer is 409
// and names every policy that uses it, and nothing changes.
func TestDeleteTypeInUse(t *testing.T) {
	ts := startServer(t, Config{})
	mustPut(t, ts.url, "/v1/types/fw", `{"instances":["10.0.0.5"]}`)
	mustPut(t, ts.url, "/v1/types/ids", `{"instances":["10.0.0.6"]}`)
	mustPut(t, ts.url, "/v1/policies/web", `{"filter":"tcp dst port 80","chain":[{"type":"fw"},{"addr":"10.0.0.2"}]}`)
	mustPut(t, ts.url, "/v1/policies/mail", `{"filter":"tcp dst port 25","chain":[{"type":"ids"},{"type":"fw"}]}`)
	before := list(t, ts.url)

	code, data := call(t, "DELETE", ts.url+"/v1/types/fw", "")
	e := decode[api.Error](t, data)
	if code != 409 || e.Error != `type "fw" is used by policies mail, web: change or remove those policies first` {
		t.Fatalf("DELETE of a type in use: %d %q, want 409 naming mail and web", code, e.Error)
	}
	if after := list(t, ts.url); after.Version != before.Version || len(after.Types) != 2 {
		t.Fatalf("a refused delete changed the set: %+v", after)
	}

	// Once no policy names it, it goes.
	if code, data := call(t, "DELETE", ts.url+"/v1/policies/mail", ""); code != 204 {
		t.Fatalf("DELETE policy: %d %s", code, data)
	}
	code, data = call(t, "DELETE", ts.url+"/v1/types/ids", "")
	if code != 204 {
		t.Fatalf("DELETE of a type no policy uses: %d %s", code, data)
	}
	code, data = call(t, "DELETE", ts.url+"/v1/types/fw", "")
	if e := decode[api.Error](t, data); code != 409 || e.Error != `type "fw" is used by policy web: change or remove that policy first` {
		t.Fatalf("DELETE of a type one policy uses: %d %q", code, e.Error)
	}
}

// damagedDB makes a real policy database (a policy, a type), runs a server
// on it once (which leaves the backup of a sound start), and returns its path.
func damagedDB(t *testing.T) string {
	t.Helper()
	db := filepath.Join(t.TempDir(), "policy.db")
	ts := startServer(t, Config{DB: db})
	mustPut(t, ts.url, "/v1/types/fw", `{"instances":["10.0.0.5"]}`)
	mustPut(t, ts.url, "/v1/policies/web", `{"filter":"tcp dst port 80","chain":[{"type":"fw"}]}`)
	ts.stop()
	startServer(t, Config{DB: db}).stop() // a sound start: the backup holds both
	return db
}

// metaOf reads the meta page bbolt uses (the valid one with the higher
// transaction id): the page size and the freelist's page.
func metaOf(t *testing.T, data []byte) (pageSize int, freelist uint64) {
	t.Helper()
	var bestTx uint64
	found := false
	for _, off := range []int{0, int(binary.LittleEndian.Uint32(data[24:]))} {
		m := data[off+16:]
		if binary.LittleEndian.Uint32(m[0:]) != 0xED0CDAED {
			continue
		}
		h := fnv.New64a()
		h.Write(m[:56])
		if h.Sum64() != binary.LittleEndian.Uint64(m[56:]) {
			continue
		}
		if tx := binary.LittleEndian.Uint64(m[48:]); !found || tx > bestTx {
			bestTx, found = tx, true
			pageSize = int(binary.LittleEndian.Uint32(m[8:]))
			freelist = binary.LittleEndian.Uint64(m[32:])
		}
	}
	if !found {
		t.Fatal("no valid meta page")
	}
	return pageSize, freelist
}

// A damaged database gives a clear error, never a panic: when bbolt panics
// on it (a freelist page whose type was overwritten: "invalid freelist
// page"), when its pages do not check out (a leaf's bytes flipped), and when
// both meta pages are overwritten. check says so too, backup refuses to copy
// it, and the copy the last sound start made brings everything back.
func TestDamagedDatabase(t *testing.T) {
	cases := []struct {
		name   string
		damage func(t *testing.T, data []byte)
		want   string
	}{
		{"freelist page type", func(t *testing.T, data []byte) {
			ps, fl := metaOf(t, data)
			binary.LittleEndian.PutUint16(data[int(fl)*ps+8:], 0x0001) // a branch page, not the freelist
		}, "invalid freelist page"},
		{"leaf pages flipped", func(t *testing.T, data []byte) {
			ps, _ := metaOf(t, data)
			for p := 2; p*ps < len(data); p++ {
				if binary.LittleEndian.Uint16(data[p*ps+8:]) == 0x02 { // leaf
					for i := 16; i < 64; i++ {
						data[p*ps+i] ^= 0xa5
					}
				}
			}
		}, "damaged"},
		{"both meta pages", func(t *testing.T, data []byte) {
			ps, _ := metaOf(t, data)
			for _, off := range []int{0, ps} {
				for i := 16; i < 80; i++ {
					data[off+i] ^= 0xff
				}
			}
		}, "invalid"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			db := damagedDB(t)
			data, err := os.ReadFile(db)
			if err != nil {
				t.Fatal(err)
			}
			c.damage(t, data)
			if err := os.WriteFile(db, data, 0o600); err != nil {
				t.Fatal(err)
			}

			_, err = New(Config{DB: db, Logger: quietLogger(), Insecure: true})
			var de *DamagedError
			if !errors.As(err, &de) {
				t.Fatalf("server on a damaged database: %v, want a DamagedError", err)
			}
			for _, w := range []string{c.want, db, "dysco policy-server check --db " + db, BackupPath(db)} {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
			t.Logf("New: %v", err)
			if _, err := Check(db); !errors.As(err, &de) {
				t.Errorf("check of a damaged database: %v", err)
			}
			out := filepath.Join(t.TempDir(), "copy.db")
			if _, err := Backup(db, out); err == nil {
				t.Error("backup copied a damaged database")
			}

			// The way out: the copy of the last sound start.
			if sum, err := Check(BackupPath(db)); err != nil || sum.Policies != 1 || sum.Types != 1 {
				t.Fatalf("check of the backup: %+v %v", sum, err)
			}
			if err := os.Rename(BackupPath(db), db); err != nil {
				t.Fatal(err)
			}
			ts := startServer(t, Config{DB: db})
			if set := list(t, ts.url); len(set.Policies) != 1 || set.Policies[0].Name != "web" || len(set.Types) != 1 {
				t.Errorf("restored database holds %+v", set)
			}
		})
	}
}

// check and backup of a sound database.
func TestCheckAndBackup(t *testing.T) {
	db := damagedDB(t)
	sum, err := Check(db)
	if err != nil || sum != (Summary{Version: 2, Policies: 1, Types: 1}) {
		t.Fatalf("check: %+v %v", sum, err)
	}
	out := filepath.Join(t.TempDir(), "copy.db")
	if _, err := Backup(db, out); err != nil {
		t.Fatal(err)
	}
	if sum, err := Check(out); err != nil || sum.Policies != 1 {
		t.Fatalf("check of the copy: %+v %v", sum, err)
	}
	// A running server holds the file: check says so rather than wait.
	startServer(t, Config{DB: db})
	if _, err := Check(db); err == nil || !strings.Contains(err.Error(), "locked by another process") {
		t.Errorf("check of a database in use: %v", err)
	}
}

// The server takes at most api.MaxTypes types (every agent gets them all,
// and its datapath holds that many) and api.MaxStoredPolicies policies; one
// more is refused with 409, a change of an existing one is fine.
func TestStoreBounds(t *testing.T) {
	ts := startServer(t, Config{})
	for i := 0; i < api.MaxTypes; i++ {
		mustPut(t, ts.url, fmt.Sprintf("/v1/types/t%d", i), `{"instances":["10.0.0.5"]}`)
	}
	code, data := call(t, "PUT", ts.url+"/v1/types/one-more", `{"instances":["10.0.0.5"]}`)
	if e := decode[api.Error](t, data); code != 409 || !strings.Contains(e.Error, "64 middlebox types already") {
		t.Errorf("type %d: %d %q", api.MaxTypes+1, code, e.Error)
	}
	mustPut(t, ts.url, "/v1/types/t0", `{"instances":["10.0.0.6"]}`)

	for i := 0; i < api.MaxStoredPolicies; i++ {
		if _, err := ts.st.PutPolicy(t.Context(), api.Policy{Name: fmt.Sprintf("p%d", i), Filter: "tcp"}); err != nil {
			t.Fatal(err)
		}
	}
	code, data = call(t, "PUT", ts.url+"/v1/policies/one-more", `{"filter":"tcp"}`)
	if e := decode[api.Error](t, data); code != 409 || !strings.Contains(e.Error, "1024 policies already") {
		t.Errorf("policy %d: %d %q", api.MaxStoredPolicies+1, code, e.Error)
	}
	mustPut(t, ts.url, "/v1/policies/p0", `{"filter":"tcp port 80"}`)

	// Sizes within one policy.
	for body, want := range map[string]string{
		`{"filter":"` + strings.Repeat("tcp or ", api.MaxFilterLen/7) + `tcp"}`:      "at most 8192",
		`{"filter":"tcp","hosts":[` + strings.Repeat(`"h",`, api.MaxHosts) + `"h"]}`: "at most 256",
		`{"filter":"tcp","hosts":["a b"]}`:                                           "not an agent name",
	} {
		code, data := call(t, "PUT", ts.url+"/v1/policies/p1", body)
		if e := decode[api.Error](t, data); code != 400 || !strings.Contains(e.Error, want) {
			t.Errorf("%.60s…: %d %q, want 400 saying %q", body, code, e.Error, want)
		}
	}
}

// A client's wait is at most MaxWait, however large the number it sends
// (a number of seconds that overflows a time.Duration included).
func TestWaitClamped(t *testing.T) {
	for n, want := range map[int]time.Duration{0: 0, 5: 5 * time.Second, 120: MaxWait, 121: MaxWait, math.MaxInt64: MaxWait, 1 << 40: MaxWait} {
		if got := waitSeconds(n); got != want {
			t.Errorf("wait=%d: %v, want %v", n, got, want)
		}
	}
	r := httptest.NewRequest("GET", "/v1/operations/x?wait=9223372036854775807", nil)
	if got, err := waitParam(r); err != nil || got != MaxWait {
		t.Errorf("waitParam: %v %v, want %v", got, err, MaxWait)
	}
}
