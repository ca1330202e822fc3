//! The PNG of a `zcnbd bench` run: one row per rw mode, each with MiB/s and IOPS against block
//! size, one colored line per target, and the loopback ceiling as a dashed line on MiB/s.
//!
//! Block sizes are categorical (one evenly spaced tick per measured size, labelled `4k`, `64k`,
//! `1m`): runs use a handful of power-of-two sizes, so even spacing is a log axis that also
//! leaves the labels on the points. The legend lives in the header, once for the whole figure,
//! so it never covers a line.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use super::report::{human, machine_line, workload_line};
use super::results::{Results, Sample};

/// DejaVu Sans (license in assets/DejaVuSans.LICENSE): plotters' ab_glyph text needs a font,
/// and embedding one keeps the plot independent of the fonts installed on the machine.
static FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

const WIDTH_PX: u32 = 1600;
/// Room for the title, the workload and two lines of legend.
const HEADER_PX: u32 = 130;
const ROW_PX: u32 = 500;
/// fio has five rw modes; more rows than this would be a bug upstream, not a plot to draw.
const RWS_MAX: u32 = 8;

/// One color per target, in command-line order (cycled past six targets).
const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];
const CEILING_COLOR: RGBColor = RGBColor(90, 90, 90);

/// Why the plot could not be written.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// The embedded font could not be parsed.
    #[error("the embedded DejaVu Sans font could not be loaded")]
    Font,
    /// The run has no rw mode, block size or target, so there is no chart to draw.
    #[error("nothing to plot: the run has no rw modes, block sizes or targets")]
    Empty,
    /// More rw modes than `RWS_MAX`: the image would be unreasonably tall.
    #[error("too many rw modes to plot: {rws} (at most {RWS_MAX})")]
    TooManyRws {
        /// How many rw modes the run has.
        rws: usize,
    },
    /// Drawing or encoding the PNG failed.
    #[error("drawing {path}: {message}")]
    Draw {
        /// The PNG being written.
        path: PathBuf,
        /// What plotters said.
        message: String,
    },
}

/// What a chart plots against block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Metric {
    MibS,
    Iops,
}

impl Metric {
    fn label(self) -> &'static str {
        match self {
            Metric::MibS => "MiB/s",
            Metric::Iops => "IOPS",
        }
    }

    fn axis_label(self) -> &'static str {
        match self {
            Metric::MibS => "MiB/s",
            Metric::Iops => "IOPS (log scale)",
        }
    }
}

/// Writes the run as a PNG to `path`: 1600 px wide, 500 px per rw mode.
pub fn write_plot(results: &Results, path: &Path) -> Result<(), PlotError> {
    if results.rws.is_empty() || results.block_sizes.is_empty() || results.targets.is_empty() {
        return Err(PlotError::Empty);
    }
    register_font_once()?;
    let rws = results.rws.len();
    let rows = u32::try_from(rws)
        .ok()
        .filter(|&rows| rows <= RWS_MAX)
        .ok_or(PlotError::TooManyRws { rws })?;
    let height = rows * ROW_PX + HEADER_PX;
    let draw_error = |e: &dyn std::fmt::Display| PlotError::Draw {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let root = BitMapBackend::new(path, (WIDTH_PX, height)).into_drawing_area();
    draw(results, &root).map_err(|e| draw_error(&e))?;
    root.present().map_err(|e| draw_error(&e))
}

/// Registers the embedded font as "sans-serif", once per process.
fn register_font_once() -> Result<(), PlotError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok =
        REGISTERED.get_or_init(|| register_font("sans-serif", FontStyle::Normal, FONT).is_ok());
    if *ok {
        Ok(())
    } else {
        Err(PlotError::Font)
    }
}

type DrawResult<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

/// The whole figure: header, then a row of two charts per rw mode.
fn draw<DB: DrawingBackend>(results: &Results, root: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
    root.fill(&WHITE)?;
    let (header, body) = root.split_vertically(HEADER_PX);
    draw_header(results, &header)?;
    let areas = body.split_evenly((results.rws.len(), 2));
    for (rw, pair) in results.rws.iter().zip(areas.chunks(2)) {
        let [left, right] = pair else { continue };
        let mib_s = Chart::new(results, rw, Metric::MibS);
        let top = mib_s.max().map_or(1.0, |max| max * 1.1);
        draw_chart(results, &mib_s, left, 0.0..top)?;
        // IOPS falls by orders of magnitude as blocks grow: on a log axis the large-block
        // points stay readable instead of lying flat on zero.
        let iops = Chart::new(results, rw, Metric::Iops);
        let (low, high) = iops.min().zip(iops.max()).unwrap_or((1.0, 10.0));
        let (low, high) = (low / 1.5, high * 1.5);
        let y_range = (low..high)
            .log_scale()
            .with_key_points(log_ticks(low, high));
        draw_chart(results, &iops, right, y_range)?;
    }
    Ok(())
}

/// Title (the machine), the workload, and the legend.
fn draw_header<DB: DrawingBackend>(
    results: &Results,
    area: &DrawingArea<DB, Shift>,
) -> DrawResult<DB> {
    let mut title = format!("zcnbd bench: {}", machine_line(&results.machine));
    if results.interrupted {
        title.push_str("  (INTERRUPTED: partial results)");
    }
    area.draw(&Text::new(title, (20, 12), ("sans-serif", 26)))?;
    let workload = workload_line(&results.workload);
    area.draw(&Text::new(workload, (20, 48), ("sans-serif", 18)))?;
    let mut entries: Vec<(String, Option<RGBColor>)> = results
        .targets
        .iter()
        .enumerate()
        .map(|(i, target)| (target.clone(), Some(PALETTE[i % PALETTE.len()])))
        .collect();
    if let Some(ceiling) = &results.ceiling {
        let best = human::mib_s(ceiling.best_mib_s());
        let label = format!("loopback ceiling (best of send/sendfile: {best} MiB/s)");
        entries.push((label, None));
    }
    draw_legend(area, &entries)
}

/// Legend entries left to right, wrapping to a second line when the first is full. A color
/// is a target's line with a dot; `None` is the ceiling's dashed line.
fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    entries: &[(String, Option<RGBColor>)],
) -> DrawResult<DB> {
    let font = TextStyle::from(("sans-serif", 18).into_font());
    let right_edge = i32::try_from(WIDTH_PX).unwrap_or(i32::MAX) - 20;
    let (mut x, mut y) = (20, 90);
    for (label, color) in entries {
        let (width, _) = area.estimate_text_size(label, &font)?;
        let width = i32::try_from(width).unwrap_or(right_edge);
        if x > 20 && x + 44 + width > right_edge {
            (x, y) = (20, y + 26);
        }
        let swatch = vec![(x, y), (x + 36, y)];
        match color {
            Some(color) => {
                area.draw(&PathElement::new(swatch, color.stroke_width(3)))?;
                area.draw(&Circle::new((x + 18, y), 5, color.filled()))?;
            }
            None => {
                let style = CEILING_COLOR.stroke_width(2);
                area.draw(&DashedPathElement::new(swatch, 8, 5, style))?;
            }
        }
        area.draw(&Text::new(label.as_str(), (x + 44, y - 9), font.clone()))?;
        x += 44 + width + 30;
    }
    Ok(())
}

/// The lines of one chart, gathered before drawing so the axis can be fitted to them.
struct Chart<'a> {
    rw: &'a str,
    metric: Metric,
    /// Per target, in command-line order: (block size index, median), positive values only.
    series: Vec<Vec<(f64, f64)>>,
    /// The loopback ceiling's best MiB/s, on the MiB/s chart.
    ceiling: Option<f64>,
}

impl<'a> Chart<'a> {
    fn new(results: &Results, rw: &'a str, metric: Metric) -> Self {
        let series = results
            .targets
            .iter()
            .map(|target| points(results, target, rw, metric))
            .collect();
        let ceiling = match metric {
            Metric::MibS => results.ceiling.map(|c| c.best_mib_s()),
            Metric::Iops => None,
        };
        Self {
            rw,
            metric,
            series,
            ceiling,
        }
    }

    fn values(&self) -> impl Iterator<Item = f64> + '_ {
        self.series
            .iter()
            .flatten()
            .map(|&(_, y)| y)
            .chain(self.ceiling)
    }

    /// The largest value, ceiling included (`None` if there is none).
    fn max(&self) -> Option<f64> {
        self.values().reduce(f64::max)
    }

    /// The smallest value (`None` if there is none).
    fn min(&self) -> Option<f64> {
        self.values().reduce(f64::min)
    }
}

/// The iodepth a plot shows: the last listed (with several, the caption says which).
fn plotted_iodepth(results: &Results) -> u32 {
    results.workload.iodepths.last().copied().unwrap_or(1)
}

/// The positive medians of `metric` for one target at every block size that ran, as
/// (block size index, value): a log axis cannot show zero, and a zero is in the table anyway.
fn points(results: &Results, target: &str, rw: &str, metric: Metric) -> Vec<(f64, f64)> {
    let value = |s: &Sample| match metric {
        Metric::MibS => s.mib_s,
        Metric::Iops => s.iops,
    };
    results
        .block_sizes
        .iter()
        .enumerate()
        .filter_map(|(i, &bs)| {
            let cell = results.cell(target, rw, bs, plotted_iodepth(results))?;
            Some((i as f64, cell.median_of(value)))
        })
        .filter(|&(_, y)| y > 0.0 && y.is_finite())
        .collect()
}

/// One chart: the metric against block size, a line per target, the ceiling when it applies.
fn draw_chart<DB, Y>(
    results: &Results,
    chart: &Chart<'_>,
    area: &DrawingArea<DB, Shift>,
    y_range: Y,
) -> DrawResult<DB>
where
    DB: DrawingBackend,
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let n = results.block_sizes.len() as f64;
    let (x_min, x_max) = (-0.3, n - 0.7);
    let mut ctx = ChartBuilder::on(area)
        .caption(
            match results.several_iodepths() {
                true => format!(
                    "{}, iodepth {}: {}",
                    chart.rw,
                    plotted_iodepth(results),
                    chart.metric.label()
                ),
                false => format!("{}: {}", chart.rw, chart.metric.label()),
            },
            ("sans-serif", 22),
        )
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(84)
        .build_cartesian_2d(x_min..x_max, y_range)?;
    let x_label = |x: &f64| block_size_label(results, *x);
    let y_label = |y: &f64| match chart.metric {
        Metric::MibS => format!("{y:.0}"),
        Metric::Iops => human::axis(*y),
    };
    ctx.configure_mesh()
        // The integers in the x range are exactly the block size indices, so asking for that
        // many labels puts one on every block size and none between.
        .x_labels(results.block_sizes.len())
        .x_desc("block size")
        .y_desc(chart.metric.axis_label())
        .x_label_formatter(&x_label)
        .y_label_formatter(&y_label)
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    for (i, points) in chart.series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        for run in contiguous_runs(points) {
            ctx.draw_series(LineSeries::new(run, color.stroke_width(3)))?;
        }
        let dots = points.iter().map(|&p| Circle::new(p, 5, color.filled()));
        ctx.draw_series(dots)?;
    }
    if let Some(best) = chart.ceiling {
        let line = vec![(x_min, best), (x_max, best)];
        let style = CEILING_COLOR.stroke_width(2);
        ctx.draw_series(DashedLineSeries::new(line, 10, 6, style))?;
    }
    Ok(())
}

/// `points` split where a block size is missing (an interrupted run), so a line never bridges
/// a cell that did not run.
fn contiguous_runs(points: &[(f64, f64)]) -> Vec<Vec<(f64, f64)>> {
    let mut runs: Vec<Vec<(f64, f64)>> = Vec::new();
    for &point in points {
        match runs.last_mut() {
            Some(run) if run.last().is_some_and(|last| point.0 - last.0 < 1.5) => run.push(point),
            _ => runs.push(vec![point]),
        }
    }
    runs
}

/// Ticks at 1, 2 and 5 times the powers of ten between `low` and `high` (positive): plotters'
/// own log ticks are either one per decade or nine, too few or too crowded.
fn log_ticks(low: f64, high: f64) -> Vec<f64> {
    // Bounds the decades walked below, whatever the numbers.
    if !(low > 0.0 && low.is_finite() && high.is_finite() && high >= low) {
        return Vec::new();
    }
    let first = low.log10().floor() as i32;
    let last = high.log10().ceil() as i32;
    (first..=last)
        .flat_map(|exp| [1.0, 2.0, 5.0].map(|m| m * 10f64.powi(exp)))
        .filter(|&tick| tick >= low && tick <= high)
        .collect()
}

/// The block size at tick `x` (`4k`), or nothing between ticks.
fn block_size_label(results: &Results, x: f64) -> String {
    let index = x.round();
    if (x - index).abs() > 1e-6 || index < 0.0 {
        return String::new();
    }
    results
        .block_sizes
        .get(index as usize)
        .map_or_else(String::new, |&bs| human::block_size(bs))
}

#[cfg(test)]
mod tests;
