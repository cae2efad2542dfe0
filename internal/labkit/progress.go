package labkit

import (
	"fmt"
	"io"
	"sync"
	"time"
)

// Progress prints what runs, the elapsed time and an estimate of what is
// left. The estimate comes from a plan of phases with expected durations:
// what is left of the current phase plus the phases still to come.
type Progress struct {
	w     io.Writer
	Tag   string // starts every line
	start time.Time

	mu       sync.Mutex
	plan     []Phase
	cur      int // index of the current phase, -1 before the first
	curStart time.Time
}

// Phase is a step of a run, with its expected duration.
type Phase struct {
	Name string
	Est  time.Duration
}

// NewProgress starts a run's progress lines on w, with the plan of its
// phases; Tag starts every line ("bench" unless changed).
func NewProgress(w io.Writer, plan []Phase) *Progress {
	return &Progress{w: w, Tag: "bench", start: time.Now(), plan: plan, cur: -1}
}

// Begin starts the named phase (phases may be skipped, never revisited).
func (p *Progress) Begin(name string) {
	p.mu.Lock()
	for i := p.cur + 1; i < len(p.plan); i++ {
		if p.plan[i].Name == name {
			p.cur = i
			break
		}
	}
	p.curStart = time.Now()
	p.mu.Unlock()
	p.Logf("%s", name)
}

// Skip drops the named phase from the estimate (a benchmark that failed
// early or was not requested).
func (p *Progress) Skip(name string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i := p.cur + 1; i < len(p.plan); i++ {
		if p.plan[i].Name == name {
			p.plan[i].Est = 0
		}
	}
}

func (p *Progress) left() time.Duration {
	var left time.Duration
	if p.cur >= 0 && p.cur < len(p.plan) {
		if r := p.plan[p.cur].Est - time.Since(p.curStart); r > 0 {
			left += r
		}
	}
	for i := p.cur + 1; i < len(p.plan); i++ {
		left += p.plan[i].Est
	}
	return left
}

func (p *Progress) Logf(format string, args ...any) {
	p.mu.Lock()
	defer p.mu.Unlock()
	fmt.Fprintf(p.w, "%s [%s elapsed, ~%s left] %s\n",
		p.Tag, FmtClock(time.Since(p.start)), FmtClock(p.left()), fmt.Sprintf(format, args...))
}

// FmtClock writes a duration as minutes:seconds.
func FmtClock(d time.Duration) string {
	s := int(d.Round(time.Second).Seconds())
	return fmt.Sprintf("%d:%02d", s/60, s%60)
}
