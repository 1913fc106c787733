//! Line charts for replay results, written as both SVG and PNG with `plotters`.
//!
//! Text on the PNG (bitmap) backend is rendered through `ab_glyph`, which needs a
//! font registered at run time: the file named by `KVMESH_PLOT_FONT`, else
//! DejaVu Sans from the Debian package `fonts-dejavu-core`. Without a font the
//! SVG is still written (its text is left to the SVG viewer) and the PNG is
//! reported as an error.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{Context, Result};
use plotters::coord::Shift;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use plotters::style::register_font;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Environment variable naming a TrueType/OpenType font file for chart text.
const FONT_ENV: &str = "KVMESH_PLOT_FONT";
/// Default font file (Debian package `fonts-dejavu-core`).
const DEFAULT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
/// Size of both images, in pixels.
const SIZE: (u32, u32) = (1024, 640);
/// Font family every text style here uses (and plotters' own default).
const FAMILY: &str = "sans-serif";

/// One line of a chart.
pub(crate) struct Series {
    /// Legend label.
    pub(crate) label: String,
    /// Points `(x, y)`, drawn in order.
    pub(crate) points: Vec<(f64, f64)>,
}

/// Axis scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scale {
    /// Linear axis.
    Linear,
    /// Base-10 logarithmic axis (only positive values are drawn).
    Log,
}

/// Description of one line chart.
pub(crate) struct Chart<'a> {
    /// Caption drawn above the plot.
    pub(crate) title: &'a str,
    /// X axis description, with units, e.g. "latency (µs)".
    pub(crate) x_label: &'a str,
    /// Y axis description, with units.
    pub(crate) y_label: &'a str,
    /// Scale of the x axis.
    pub(crate) x_scale: Scale,
    /// Fixed y range; `None` derives it from the data.
    pub(crate) y_range: Option<(f64, f64)>,
    /// The lines to draw.
    pub(crate) series: &'a [Series],
}

/// A chart with its data filtered and its ranges decided.
struct Prepared {
    title: String,
    x_label: String,
    y_label: String,
    x_scale: Scale,
    x: (f64, f64),
    y: (f64, f64),
    series: Vec<(String, Vec<(f64, f64)>)>,
}

/// Writes `<stem>.svg` and `<stem>.png` (1024x640), returns both paths.
///
/// Empty series are skipped; a chart with no points at all is still written with
/// "(no data)" in its title. On a log x axis, points with `x <= 0` are dropped.
/// The SVG is written first, so it exists even when the PNG fails for want of a
/// font.
pub(crate) fn line_chart(stem: &Path, chart: &Chart<'_>) -> Result<Vec<PathBuf>> {
    let prepared = prepare(chart);
    let svg = with_suffix(stem, ".svg");
    let png = with_suffix(stem, ".png");
    if let Some(parent) = svg.parent()
        && !parent.as_os_str().is_empty()
    {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }

    let font = ensure_font();

    {
        let root = SVGBackend::new(&svg, SIZE).into_drawing_area();
        draw(&root, &prepared, font.is_ok()).with_context(|| format!("drawing {}", svg.display()))?;
        root.present().map_err(|e| anyhow::anyhow!("writing {}: {e}", svg.display()))?;
    }

    if let Err(e) = font {
        anyhow::bail!("wrote {} but not {}: {e}", svg.display(), png.display());
    }

    {
        let root = BitMapBackend::new(&png, SIZE).into_drawing_area();
        draw(&root, &prepared, true).with_context(|| format!("drawing {}", png.display()))?;
        root.present().map_err(|e| anyhow::anyhow!("writing {}: {e}", png.display()))?;
    }

    Ok(vec![svg, png])
}

/// Points of a latency CDF from a histogram of latencies in microseconds:
/// `(latency_us, percentile 0..=100)` at percentiles 0, 0.5, ..., 99, 99.5, 99.9,
/// 99.99 and 100 (about 200 points). Empty histogram: no points.
pub(crate) fn cdf_from_histogram(h: &hdrhistogram::Histogram<u64>) -> Vec<(f64, f64)> {
    if h.is_empty() {
        return Vec::new();
    }
    let mut percentiles: Vec<f64> = (0..199u32).map(|i| f64::from(i) * 0.5).collect();
    percentiles.extend([99.5, 99.9, 99.99, 100.0]);
    percentiles.into_iter().map(|pct| (h.value_at_quantile(pct / 100.0) as f64, pct)).collect()
}

/// `stem` with `suffix` appended (not replacing any dot already in the name).
fn with_suffix(stem: &Path, suffix: &str) -> PathBuf {
    let mut s: OsString = stem.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// Registers the chart font once; the result is remembered.
fn ensure_font() -> std::result::Result<(), String> {
    static FONT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    FONT.get_or_init(load_font).clone()
}

/// Loads the first usable font file and registers it for the families plotters
/// looks up ("sans-serif" is the one used here and plotters' default).
fn load_font() -> std::result::Result<(), String> {
    let mut candidates = Vec::new();
    if let Some(p) = std::env::var_os(FONT_ENV)
        && !p.is_empty()
    {
        candidates.push(PathBuf::from(p));
    }
    candidates.push(PathBuf::from(DEFAULT_FONT));

    let mut problems = Vec::new();
    for path in candidates {
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) => {
                problems.push(format!("{}: {e}", path.display()));
                continue;
            }
        };
        // ab_glyph keeps `&'static` font data; this runs at most once per file.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        let mut ok = true;
        for family in [FAMILY, "serif", "monospace"] {
            if register_font(family, FontStyle::Normal, bytes).is_err() {
                ok = false;
                break;
            }
        }
        if ok {
            return Ok(());
        }
        problems.push(format!("{}: not a valid TrueType/OpenType font", path.display()));
    }
    Err(format!(
        "no usable font for chart text ({}); install the Debian package fonts-dejavu-core \
         or set {FONT_ENV} to a .ttf file",
        problems.join("; ")
    ))
}

/// Filters the data and decides the axis ranges.
fn prepare(chart: &Chart<'_>) -> Prepared {
    let log_x = chart.x_scale == Scale::Log;
    let series: Vec<(String, Vec<(f64, f64)>)> = chart
        .series
        .iter()
        .map(|s| {
            let pts: Vec<(f64, f64)> = s
                .points
                .iter()
                .copied()
                .filter(|&(x, y)| x.is_finite() && y.is_finite() && (!log_x || x > 0.0))
                .collect();
            (s.label.clone(), pts)
        })
        .filter(|(_, pts)| !pts.is_empty())
        .collect();

    let all = || series.iter().flat_map(|(_, pts)| pts.iter().copied());
    let has_data = all().next().is_some();
    let title = if has_data { chart.title.to_owned() } else { format!("{} (no data)", chart.title) };

    let x = if has_data {
        let lo = all().map(|p| p.0).fold(f64::INFINITY, f64::min);
        let hi = all().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max);
        if hi > lo {
            (lo, hi)
        } else if log_x {
            (lo / 2.0, hi * 2.0)
        } else {
            (lo - 1.0, hi + 1.0)
        }
    } else if log_x {
        (1.0, 10.0)
    } else {
        (0.0, 1.0)
    };

    let y = match chart.y_range {
        Some((lo, hi)) if lo.is_finite() && hi.is_finite() && hi > lo => (lo, hi),
        _ if has_data => {
            let lo = all().map(|p| p.1).fold(f64::INFINITY, f64::min);
            let hi = all().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
            let span = if hi > lo { hi - lo } else { hi.abs().max(1.0) };
            let top = hi + 0.05 * span;
            let bottom = if lo >= 0.0 { 0.0 } else { lo - 0.05 * span };
            (bottom, top)
        }
        _ => (0.0, 1.0),
    };

    Prepared {
        title,
        x_label: chart.x_label.to_owned(),
        y_label: chart.y_label.to_owned(),
        x_scale: chart.x_scale,
        x,
        y,
        series,
    }
}

/// Converts a plotters error (not always `Send + Sync + 'static`) to anyhow.
fn plot_err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow::anyhow!("plotting failed: {e}")
}

/// Text style in the chart family at `size` pixels.
fn text(size: u32) -> TextStyle<'static> {
    TextStyle::from((FAMILY, f64::from(size)).into_font())
}

/// Draws the whole chart on `root`. `font_ok` false avoids every plotters call
/// that measures text (only possible on the SVG backend, which does not rasterize
/// text itself).
fn draw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, p: &Prepared, font_ok: bool) -> Result<()> {
    root.fill(&WHITE).map_err(plot_err)?;
    let (w, _) = root.dim_in_pixel();
    let title_style = text(24).pos(Pos::new(HPos::Center, VPos::Top));
    let half_w = i32::try_from(w / 2).unwrap_or(0);
    root.draw_text(&p.title, &title_style, (half_w, 12)).map_err(plot_err)?;
    match p.x_scale {
        Scale::Linear => draw_plot(root, p, p.x.0..p.x.1, font_ok),
        Scale::Log => draw_plot(root, p, (p.x.0..p.x.1).log_scale(), font_ok),
    }
}

/// Draws mesh, lines and legend for one x coordinate kind (linear or log).
fn draw_plot<DB, XS>(root: &DrawingArea<DB, Shift>, p: &Prepared, x_spec: XS, font_ok: bool) -> Result<()>
where
    DB: DrawingBackend,
    XS: AsRangedCoord<Value = f64>,
    XS::CoordDescType: ValueFormatter<f64>,
{
    let mut ctx = ChartBuilder::on(root)
        .margin(20)
        .margin_top(56)
        .x_label_area_size(56)
        .y_label_area_size(84)
        .build_cartesian_2d(x_spec, p.y.0..p.y.1)
        .map_err(plot_err)?;

    let fmt_x = |v: &f64| fmt_num(*v);
    let fmt_y = |v: &f64| fmt_num(*v);
    ctx.configure_mesh()
        .x_desc(p.x_label.as_str())
        .y_desc(p.y_label.as_str())
        .x_label_formatter(&fmt_x)
        .y_label_formatter(&fmt_y)
        .axis_desc_style(text(18))
        .label_style(text(14))
        .bold_line_style(BLACK.mix(0.15).stroke_width(1))
        .light_line_style(BLACK.mix(0.05).stroke_width(1))
        .draw()
        .map_err(plot_err)?;

    for (i, (label, pts)) in p.series.iter().enumerate() {
        let style = Palette99::pick(i).stroke_width(2);
        let anno = ctx.draw_series(LineSeries::new(pts.iter().copied(), style)).map_err(plot_err)?;
        if font_ok {
            anno.label(label.as_str()).legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
        }
    }

    if p.series.is_empty() {
        return Ok(());
    }

    if font_ok {
        ctx.configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .margin(10)
            .label_font(text(15))
            .background_style(WHITE.filled())
            .border_style(BLACK.stroke_width(1))
            .draw()
            .map_err(plot_err)?;
        return Ok(());
    }

    // No font: plotters' legend measures its text, so lay one out by hand with an
    // estimated text width; the SVG viewer renders the text itself.
    let area = ctx.plotting_area().strip_coord_spec();
    let line_h = 20i32;
    let n = i32::try_from(p.series.len()).unwrap_or(i32::MAX / line_h - 1);
    let max_chars = p.series.iter().map(|(l, _)| l.chars().count()).max().unwrap_or(0);
    let text_w = i32::try_from(max_chars).unwrap_or(200).saturating_mul(8);
    let (x0, y0) = (10i32, 10i32);
    let (x1, y1) = (x0 + 44 + text_w + 10, y0 + line_h * n + 10);
    area.draw(&Rectangle::new([(x0, y0), (x1, y1)], WHITE.filled())).map_err(plot_err)?;
    area.draw(&Rectangle::new([(x0, y0), (x1, y1)], BLACK.stroke_width(1))).map_err(plot_err)?;
    let label_style = text(15).pos(Pos::new(HPos::Left, VPos::Center));
    for (i, (label, _)) in p.series.iter().enumerate() {
        let row = i32::try_from(i).unwrap_or(0);
        let y = y0 + 5 + line_h * row + line_h / 2;
        let style = Palette99::pick(i).stroke_width(2);
        area.draw(&PathElement::new(vec![(x0 + 10, y), (x0 + 34, y)], style)).map_err(plot_err)?;
        area.draw_text(label, &label_style, (x0 + 44, y)).map_err(plot_err)?;
    }
    Ok(())
}

/// Compact tick label for a number.
fn fmt_num(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        return "0".to_owned();
    }
    if !(1e-3..1e6).contains(&a) {
        return format!("{v:.1e}");
    }
    if a >= 100.0 || v.fract() == 0.0 {
        return format!("{v:.0}");
    }
    let s = if a >= 1.0 { format!("{v:.2}") } else { format!("{v:.3}") };
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let dir = std::env::temp_dir().join(format!("kvmesh-plot-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn non_empty(path: &Path) -> bool {
        std::fs::metadata(path).map(|m| m.len() > 0).unwrap_or(false)
    }

    #[test]
    fn writes_svg_and_png() {
        let dir = temp_dir("chart");
        let font = ensure_font();
        if let Err(e) = &font {
            eprintln!("skipping PNG checks: {e}");
        }
        let series = vec![
            Series {
                label: "replica-a".to_owned(),
                points: vec![(1.0, 10.0), (10.0, 50.0), (100.0, 99.0), (1000.0, 100.0)],
            },
            Series {
                label: "replica-b".to_owned(),
                points: vec![(0.0, 0.0), (2.0, 20.0), (20.0, 70.0), (400.0, 100.0)],
            },
            Series { label: "empty".to_owned(), points: Vec::new() },
        ];
        for scale in [Scale::Linear, Scale::Log] {
            for y_range in [Some((0.0, 100.0)), None] {
                let chart = Chart {
                    title: "test latency cdf",
                    x_label: "latency (µs)",
                    y_label: "percentile (%)",
                    x_scale: scale,
                    y_range,
                    series: &series,
                };
                let stem = dir.join(format!("chart-{scale:?}-{}", y_range.is_some()));
                let res = line_chart(&stem, &chart);
                let svg = with_suffix(&stem, ".svg");
                let png = with_suffix(&stem, ".png");
                assert!(non_empty(&svg), "{} missing or empty", svg.display());
                let svg_text = std::fs::read_to_string(&svg).unwrap();
                assert!(svg_text.contains("test latency cdf"));
                assert!(svg_text.contains("replica-a"));
                assert!(svg_text.contains("replica-b"));
                if font.is_ok() {
                    let paths = res.unwrap();
                    assert_eq!(paths, vec![svg.clone(), png.clone()]);
                    assert!(non_empty(&png), "{} missing or empty", png.display());
                } else {
                    assert!(res.is_err());
                }
            }
        }

        let empty = Chart {
            title: "nothing here",
            x_label: "latency (µs)",
            y_label: "percentile (%)",
            x_scale: Scale::Log,
            y_range: None,
            series: &[],
        };
        let stem = dir.join("empty");
        let res = line_chart(&stem, &empty);
        let svg_text = std::fs::read_to_string(with_suffix(&stem, ".svg")).unwrap();
        assert!(svg_text.contains("no data"));
        if font.is_ok() {
            res.unwrap();
            assert!(non_empty(&with_suffix(&stem, ".png")));
        }

        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn cdf_points() {
        let mut h = hdrhistogram::Histogram::<u64>::new(3).unwrap();
        assert!(cdf_from_histogram(&h).is_empty());
        for v in 1..=1000u64 {
            h.record(v).unwrap();
        }
        let pts = cdf_from_histogram(&h);
        assert!(pts.len() >= 150 && pts.len() <= 210, "{} points", pts.len());
        assert!(pts.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 < w[1].1));
        let first = pts[0];
        let last = pts[pts.len() - 1];
        assert!(first.0 <= 1.0 && first.1.abs() < 1e-9);
        assert!((last.0 - 1000.0).abs() <= 1.0 && (last.1 - 100.0).abs() < 1e-9);
    }

    #[test]
    fn tick_labels() {
        assert_eq!(fmt_num(0.0), "0");
        assert_eq!(fmt_num(250.0), "250");
        assert_eq!(fmt_num(2.5), "2.5");
        assert_eq!(fmt_num(0.125), "0.125");
        assert_eq!(fmt_num(2_000_000.0), "2.0e6");
    }
}
