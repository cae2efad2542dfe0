package experiment

// Writers of an experiment's files: CSV tables, PNG plots (gonum/plot),
// data.json and report.md.

import (
	"encoding/csv"
	"encoding/json"
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"

	"github.com/dysco/dysco/internal/labkit"
)

// WriteCSV writes a table to OutDir/name and lists it among the result's
// files.
func (env *Env) WriteCSV(name string, header []string, rows [][]string) error {
	f, err := os.Create(filepath.Join(env.OutDir, name))
	if err != nil {
		return err
	}
	w := csv.NewWriter(f)
	if err := w.Write(header); err != nil {
		f.Close()
		return err
	}
	if err := w.WriteAll(rows); err != nil {
		f.Close()
		return err
	}
	env.files = append(env.files, name)
	return f.Close()
}

// SavePlots draws plots stacked in one column into OutDir/name (PNG),
// sharing the width; height is per plot.
func (env *Env) SavePlots(name string, height vg.Length, ps ...*plot.Plot) error {
	const width = 7 * vg.Inch
	img := vgimg.NewWith(vgimg.UseWH(width, height*vg.Length(len(ps))), vgimg.UseDPI(110))
	dc := draw.New(img)
	grid := make([][]*plot.Plot, len(ps))
	for i, p := range ps {
		grid[i] = []*plot.Plot{p}
	}
	cs := plot.Align(grid, draw.Tiles{Rows: len(ps), Cols: 1, PadY: vg.Millimeter * 2, PadX: vg.Millimeter * 2}, dc)
	for i, p := range ps {
		p.Draw(cs[i][0])
	}
	f, err := os.Create(filepath.Join(env.OutDir, name))
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// Colours of the series: Dysco blue, baseline grey, then others.
var palette = []color.Color{
	color.RGBA{R: 31, G: 119, B: 180, A: 255},
	color.RGBA{R: 127, G: 127, B: 127, A: 255},
	color.RGBA{R: 214, G: 39, B: 40, A: 255},
	color.RGBA{R: 44, G: 160, B: 44, A: 255},
	color.RGBA{R: 255, G: 127, B: 14, A: 255},
	color.RGBA{R: 148, G: 103, B: 189, A: 255},
	color.RGBA{R: 140, G: 86, B: 75, A: 255},
	color.RGBA{R: 23, G: 190, B: 207, A: 255},
}

func colour(i int) color.Color { return palette[i%len(palette)] }

func newPlot(title, x, y string) *plot.Plot {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = x
	p.Y.Label.Text = y
	p.Add(plotter.NewGrid())
	p.Legend.Top = true
	return p
}

// series is a named line of (x, y) points.
type series struct {
	name string
	xy   plotter.XYs
}

// addLines adds lines with points to p.
func addLines(p *plot.Plot, ss []series, points bool) error {
	for i, s := range ss {
		if len(s.xy) == 0 {
			continue
		}
		l, err := plotter.NewLine(s.xy)
		if err != nil {
			return err
		}
		l.Color = colour(i)
		l.Width = vg.Points(1.5)
		p.Add(l)
		p.Legend.Add(s.name, l)
		if points {
			sc, err := plotter.NewScatter(s.xy)
			if err != nil {
				return err
			}
			sc.GlyphStyle.Color = colour(i)
			sc.GlyphStyle.Radius = vg.Points(2.5)
			p.Add(sc)
		}
	}
	return nil
}

// barGroup is one group of a grouped bar chart: a label and a value per
// series (NaN: none).
type barGroup struct {
	label  string
	values []float64
}

// barChart draws groups of bars, one bar per series in each group.
func barChart(title, ylabel string, names []string, groups []barGroup) (*plot.Plot, error) {
	p := newPlot(title, "", ylabel)
	w := vg.Points(22)
	for i, name := range names {
		vals := make(plotter.Values, len(groups))
		for j, g := range groups {
			if i < len(g.values) && !math.IsNaN(g.values[i]) {
				vals[j] = g.values[i]
			}
		}
		b, err := plotter.NewBarChart(vals, w)
		if err != nil {
			return nil, err
		}
		b.Color = colour(i)
		b.LineStyle.Width = 0
		b.Offset = w * vg.Length(2*i-len(names)+1) / 2
		p.Add(b)
		p.Legend.Add(name, b)
	}
	var labels []string
	for _, g := range groups {
		labels = append(labels, g.label)
	}
	p.NominalX(labels...)
	p.Y.Min = 0
	p.Y.Max *= 1.3 // room for the legend
	return p, nil
}

// cdf returns the empirical CDF of xs as points.
func cdf(xs []float64) plotter.XYs {
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	out := make(plotter.XYs, 0, len(s))
	for i, x := range s {
		out = append(out, plotter.XY{X: x, Y: float64(i+1) / float64(len(s))})
	}
	return out
}

// vline is a vertical line at x from y0 to y1, for marking events.
func vline(p *plot.Plot, x, y0, y1 float64, c color.Color) error {
	l, err := plotter.NewLine(plotter.XYs{{X: x, Y: y0}, {X: x, Y: y1}})
	if err != nil {
		return err
	}
	l.Color = c
	l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
	p.Add(l)
	return nil
}

// writeResult writes data.json and report.md.
func writeResult(dir string, r *Result) error {
	data, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return fmt.Errorf("data.json: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "data.json"), append(data, '\n'), 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "report.md"), []byte(reportMarkdown(r)), 0o644)
}

// reportMarkdown is report.md: set-up, our figures beside the paper's,
// what each plot shows, the raw data.
func reportMarkdown(r *Result) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# %s: %s (paper %s)\n\n", r.Experiment, r.Title, r.Paper)
	fmt.Fprintf(&b, "Run of %s UTC (%s size, took %s): `%s`. ", r.Started.Format("2006-01-02 15:04"), r.Size,
		labkit.FmtClock(r.Finished.Sub(r.Started)), r.Command)
	m := r.Machine
	fmt.Fprintf(&b, "Machine: Linux %s, %d CPUs, %s; %s; commit %s. Every lab host, the agents, the programs measured and the runner share these CPUs.\n\n",
		m.Kernel, m.Nproc, m.CPU, m.Go, m.Commit)
	if len(r.Problems) > 0 {
		b.WriteString("**Checks that FAILED in this run:**\n\n")
		for _, p := range r.Problems {
			fmt.Fprintf(&b, "- %s\n", p)
		}
		b.WriteString("\n")
	}
	b.WriteString("## Set-up\n\n")
	for _, s := range r.Setup {
		fmt.Fprintf(&b, "- %s\n", s)
	}
	b.WriteString("\n## Our figures and the paper's\n\n| figure | ours | paper | difference |\n|---|---|---|---|\n")
	for _, c := range r.Comparisons {
		fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", cell(c.What), cell(c.Ours), cell(c.Paper), cell(c.Difference))
	}
	if len(r.Plots) > 0 {
		b.WriteString("\n## Plots\n")
		for _, p := range r.Plots {
			fmt.Fprintf(&b, "\n### %s\n\n![%s](%s)\n\n%s\n", p.Title, p.Title, p.File, p.Shows)
		}
	}
	if len(r.Notes) > 0 {
		b.WriteString("\n## Notes\n\n")
		for _, n := range r.Notes {
			fmt.Fprintf(&b, "- %s\n", n)
		}
	}
	b.WriteString("\n## Raw data\n\n`data.json` (everything above, with every sample)")
	for _, f := range r.Files {
		fmt.Fprintf(&b, ", `%s`", f)
	}
	b.WriteString(".\n")
	return b.String()
}

func cell(s string) string { return strings.ReplaceAll(strings.ReplaceAll(s, "|", "\\|"), "\n", " ") }

// f1, f2 format numbers for tables.
func f1(v float64) string { return fmtNum(v, 1) }
func f2(v float64) string { return fmtNum(v, 2) }

func fmtNum(v float64, prec int) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "–"
	}
	return fmt.Sprintf("%.*f", prec, v)
}

// pct formats a relative difference a/b-1 in percent.
func pct(a, b float64) string {
	if b == 0 || math.IsNaN(a) || math.IsNaN(b) {
		return "–"
	}
	return fmt.Sprintf("%+.1f %%", 100*(a/b-1))
}
