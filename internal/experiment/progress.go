package experiment

import (
	"fmt"
	"io"
	"sync"
	"time"
)

// progress prints what runs, the elapsed time and an estimate of what is
// left. The estimate comes from a plan of phases with expected durations:
// what is left of the current phase plus the phases still to come.
type progress struct {
	w     io.Writer
	tag   string // starts every line
	start time.Time

	mu       sync.Mutex
	plan     []phase
	cur      int // index of the current phase, -1 before the first
	curStart time.Time
}

type phase struct {
	name string
	est  time.Duration
}

func newProgress(w io.Writer, plan []phase) *progress {
	return &progress{w: w, tag: "bench", start: time.Now(), plan: plan, cur: -1}
}

// begin starts the named phase (phases may be skipped, never revisited).
func (p *progress) begin(name string) {
	p.mu.Lock()
	for i := p.cur + 1; i < len(p.plan); i++ {
		if p.plan[i].name == name {
			p.cur = i
			break
		}
	}
	p.curStart = time.Now()
	p.mu.Unlock()
	p.logf("%s", name)
}

// skip drops the named phase from the estimate (a benchmark that failed
// early or was not requested).
func (p *progress) skip(name string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i := p.cur + 1; i < len(p.plan); i++ {
		if p.plan[i].name == name {
			p.plan[i].est = 0
		}
	}
}

func (p *progress) left() time.Duration {
	var left time.Duration
	if p.cur >= 0 && p.cur < len(p.plan) {
		if r := p.plan[p.cur].est - time.Since(p.curStart); r > 0 {
			left += r
		}
	}
	for i := p.cur + 1; i < len(p.plan); i++ {
		left += p.plan[i].est
	}
	return left
}

func (p *progress) logf(format string, args ...any) {
	p.mu.Lock()
	defer p.mu.Unlock()
	fmt.Fprintf(p.w, "%s [%s elapsed, ~%s left] %s\n",
		p.tag, fmtClock(time.Since(p.start)), fmtClock(p.left()), fmt.Sprintf(format, args...))
}

func fmtClock(d time.Duration) string {
	s := int(d.Round(time.Second).Seconds())
	return fmt.Sprintf("%d:%02d", s/60, s%60)
}
