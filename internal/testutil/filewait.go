package testutil

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// FileWaiter waits, through inotify and with a deadline, for a file to be
// written after the waiter was made: the way tests wait on a ready file
// without sleeping.
type FileWaiter struct {
	f    *os.File
	path string
}

// NewFileWaiter starts watching path's folder.
func NewFileWaiter(t testing.TB, path string) *FileWaiter {
	t.Helper()
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		t.Fatalf("inotify: %v", err)
	}
	if _, err := unix.InotifyAddWatch(fd, filepath.Dir(path), unix.IN_MOVED_TO|unix.IN_CLOSE_WRITE); err != nil {
		unix.Close(fd)
		t.Fatalf("inotify watch %s: %v", filepath.Dir(path), err)
	}
	f := os.NewFile(uintptr(fd), "inotify")
	t.Cleanup(func() { f.Close() })
	return &FileWaiter{f: f, path: path}
}

// Wait returns the trimmed content of the file once written.
func (w *FileWaiter) Wait(t testing.TB) string {
	t.Helper()
	w.f.SetReadDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 4096)
	for {
		n, err := w.f.Read(buf)
		if err != nil {
			t.Fatalf("waiting for %s: %v", w.path, err)
		}
		for b := buf[:n]; len(b) >= unix.SizeofInotifyEvent; {
			ev := (*unix.InotifyEvent)(unsafe.Pointer(&b[0]))
			name := string(bytes.TrimRight(b[unix.SizeofInotifyEvent:unix.SizeofInotifyEvent+int(ev.Len)], "\x00"))
			b = b[unix.SizeofInotifyEvent+int(ev.Len):]
			if name != filepath.Base(w.path) {
				continue
			}
			data, err := os.ReadFile(w.path)
			if err != nil {
				t.Fatalf("reading %s: %v", w.path, err)
			}
			return strings.TrimSpace(string(data))
		}
	}
}
