//! `bench --plot`: speed and extra memory against sequence length, flashattn (solid lines), the
//! standard attention (dashed) and, with `--linear`, linear attention (dotted), as PNG or SVG. Text is drawn with DejaVu Sans, embedded in the
//! binary (`assets/fonts/`, with its license), so no system font is needed.

use std::path::Path;

use flashattn::Device;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use super::args::Layout;
use super::bench::{Outcome, Row};
use super::output::write_bytes_atomic;
use super::timing::Measurement;
use super::{CliResult, fail};

const FONT: &[u8] = include_bytes!("../assets/fonts/DejaVuSans.ttf");
const SIZE: (u32, u32) = (1400, 620);
const MIB: f64 = 1024.0 * 1024.0;
/// Memory below this (MiB) is drawn at this value: a log axis has no 0.
const MEMORY_FLOOR_MIB: f64 = 1e-3;
/// Dash and gap (pixels) of the standard attention's lines and of linear attention's.
const STANDARD_DASH: (u32, u32) = (10, 6);
const LINEAR_DASH: (u32, u32) = (3, 5);
const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// The output format, from the file name.
enum Format {
    Png,
    Svg,
}

fn format_of(path: &Path) -> CliResult<Format> {
    match path.extension().and_then(|e| e.to_str()) {
        Some(e) if e.eq_ignore_ascii_case("png") => Ok(Format::Png),
        Some(e) if e.eq_ignore_ascii_case("svg") => Ok(Format::Svg),
        _ => Err(fail(format!(
            "--plot {}: expected a file name ending in .png or .svg",
            path.display()
        ))),
    }
}

/// Checks the chart's file name before the sweep runs.
pub fn check_extension(path: &Path) -> CliResult<()> {
    format_of(path).map(drop)
}

/// One line of the chart: a method on one (pass, dtype, head dim, mask, and key length or
/// layout where those vary) over sequence lengths.
type Point = (f64, f64, f64, f64);

struct Series {
    label: String,
    color: RGBColor,
    /// Dash length and gap in pixels; `None`: a solid line.
    dash: Option<(u32, u32)>,
    /// (seqlen, rate in the chart's unit, extra MiB or NaN when not known, time in ms).
    points: Vec<Point>,
}

/// The series of `rows`, rates in GFLOP/s divided by `gflops_per_unit`.
fn series(rows: &[Row], gflops_per_unit: f64) -> Vec<Series> {
    let mut groups: Vec<(String, Vec<&Row>)> = Vec::new();
    // With key lengths apart from the query lengths (--seqlens-k), a line per key length over
    // the query lengths, the rows where the two happen to be equal included.
    let per_key_length = rows.iter().any(|r| r.config.nk != r.config.nq);
    // A line per memory layout where a row is not in the default one (`bench --layout`).
    let per_layout = rows.iter().any(|r| r.config.layout != Layout::Bnhd);
    for r in rows {
        let c = &r.config;
        let mut key = format!(
            "{} {} D={} {}",
            r.pass.name(),
            if c.is_causal() { "causal" } else { "full" },
            c.d,
            c.dtype
        );
        if per_key_length {
            key += &format!(" Nk={}", c.nk);
        }
        if per_layout {
            key += &format!(" {}", c.layout.name());
        }
        match groups.iter_mut().find(|g| g.0 == key) {
            Some(g) => g.1.push(r),
            None => groups.push((key, vec![r])),
        }
    }
    let point = |r: &Row, m: &Measurement| {
        (
            r.config.nq as f64,
            m.gflops / gflops_per_unit,
            m.extra
                .bytes()
                .map_or(f64::NAN, |b| (b as f64 / MIB).max(MEMORY_FLOOR_MIB)),
            m.time_ms,
        )
    };
    let mut out = Vec::new();
    for (i, (key, rs)) in groups.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        out.push(Series {
            label: format!("flashattn {key}"),
            color,
            dash: None,
            points: rs.iter().map(|r| point(r, &r.flash)).collect(),
        });
        let baselines = [
            ("standard", STANDARD_DASH, false),
            ("linear", LINEAR_DASH, true),
        ];
        for (method, dash, linear) in baselines {
            let points: Vec<_> = rs
                .iter()
                .filter_map(|r| match baseline(r, linear) {
                    Some(Outcome::Ran(m)) => Some(point(r, m)),
                    _ => None,
                })
                .collect();
            if !points.is_empty() {
                out.push(Series {
                    label: format!("{method} {key}"),
                    color,
                    dash: Some(dash),
                    points,
                });
            }
        }
    }
    out
}

/// A row's standard attention, or its linear attention (with `--linear`).
fn baseline(r: &Row, linear: bool) -> Option<&Outcome> {
    match linear {
        false => Some(&r.standard),
        true => r.linear.as_ref(),
    }
}

type DrawResult = Result<(), Box<dyn std::error::Error>>;

/// Draws one panel: `value` of each point against sequence length.
fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    all: &[Series],
    title: &str,
    y_desc: &str,
    log_y: bool,
    value: fn(&Point) -> f64,
    legend: bool,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let xs = all.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let (xmin, xmax) = xs.fold((f64::INFINITY, 0f64), |(a, b), x| (a.min(x), b.max(x)));
    let ys = all
        .iter()
        .flat_map(|s| s.points.iter().map(value))
        .filter(|y| y.is_finite());
    let (ymin, ymax) = ys.fold((f64::INFINITY, 0f64), |(a, b), y| (a.min(y), b.max(y)));
    let mut ticks: Vec<f64> = all
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .collect();
    ticks.sort_by(f64::total_cmp);
    ticks.dedup();
    let x_range = ((xmin / 1.3)..(xmax * 1.3))
        .log_scale()
        .with_key_points(ticks);
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(80);
    let style = |s: &Series| ShapeStyle::from(&s.color).stroke_width(2);
    macro_rules! draw_series {
        ($chart:expr) => {{
            let chart = &mut $chart;
            chart
                .configure_mesh()
                .x_desc("sequence length (queries = keys)")
                .y_desc(y_desc)
                .label_style(("sans-serif", 16))
                .axis_desc_style(("sans-serif", 18))
                .x_label_formatter(&|x| format!("{x:.0}"))
                .y_label_formatter(&|y| {
                    if *y >= 10.0 {
                        format!("{y:.0}")
                    } else {
                        format!("{y}")
                    }
                })
                .draw()?;
            for s in all {
                let pts: Vec<(f64, f64)> = s
                    .points
                    .iter()
                    .map(|p| (p.0, value(p)))
                    .filter(|p| p.1.is_finite())
                    .collect();
                if pts.is_empty() {
                    continue;
                }
                let legend_style = style(s);
                match s.dash {
                    Some((on, off)) => {
                        chart.draw_series(DashedLineSeries::new(pts.clone(), on, off, style(s)))?
                    }
                    None => chart.draw_series(LineSeries::new(pts.clone(), style(s)))?,
                };
                // The legend's stroke: one dash, or a solid stretch.
                let len = s.dash.map_or(24, |(on, _)| on as i32);
                chart
                    .draw_series(pts.iter().map(|&p| Circle::new(p, 4, style(s).filled())))?
                    .label(s.label.clone())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + len, y)], legend_style)
                    });
            }
            if legend {
                chart
                    .configure_series_labels()
                    .position(SeriesLabelPosition::UpperLeft)
                    .label_font(("sans-serif", 15))
                    .background_style(WHITE.mix(0.85))
                    .border_style(BLACK)
                    .draw()?;
            }
        }};
    }
    if log_y {
        let mut chart =
            builder.build_cartesian_2d(x_range, ((ymin / 3.0)..(ymax * 30.0)).log_scale())?;
        draw_series!(chart);
    } else {
        let mut chart = builder.build_cartesian_2d(x_range, 0.0..ymax * 1.15)?;
        draw_series!(chart);
    }
    Ok(())
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, rows: &[Row]) -> DrawResult
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let first = &rows[0];
    let linear = match rows.iter().any(|r| r.linear.is_some()) {
        true => ", linear attention (dotted)",
        false => "",
    };
    let title = format!(
        "flashattn (solid) vs standard attention (dashed){linear} on {}, B={} H={}",
        first.device, first.config.batch, first.config.heads
    );
    let (top, rest) = root.split_vertically(44);
    top.titled(&title, ("sans-serif", 26))?;
    let (body, bottom) = rest.split_vertically(SIZE.1 - 44 - 28);
    // One note per sequence length (the masks and head dims of one length share the reason).
    let mut skipped: Vec<(usize, &str)> = Vec::new();
    for r in rows {
        if let Outcome::Skipped(why) = &r.standard
            && !skipped.iter().any(|s| s.0 == r.config.nq)
        {
            skipped.push((r.config.nq, why));
        }
    }
    let skipped: Vec<String> = skipped
        .iter()
        .map(|(n, why)| format!("N={n} ({why})"))
        .collect();
    let mut notes = Vec::new();
    if !skipped.is_empty() {
        notes.push(format!(
            "standard attention skipped at {}",
            skipped.join("; ")
        ));
    }
    if let Some(why) = rows.iter().find_map(|r| match &r.linear {
        Some(Outcome::Skipped(why)) => Some(why),
        _ => None,
    }) {
        notes.push(format!("linear attention skipped: {why}"));
    }
    let floored = rows.iter().any(|r| {
        let small = |m: &Measurement| {
            m.extra
                .bytes()
                .is_some_and(|b| (b as f64) < MEMORY_FLOOR_MIB * MIB)
        };
        small(&r.flash) || matches!(&r.standard, Outcome::Ran(m) if small(m))
    });
    if floored {
        notes.push(format!(
            "extra memory below {MEMORY_FLOOR_MIB} MiB (0 B included) is drawn at {MEMORY_FLOOR_MIB} MiB"
        ));
    }
    if !notes.is_empty() {
        let note = notes.join(" | ");
        bottom.draw_text(
            &note,
            &("sans-serif", 15).into_font().color(&BLACK),
            (20, 4),
        )?;
    }
    let (left, right) = body.split_horizontally(SIZE.0 / 2);
    let (per_unit, unit) = match first.device {
        Device::Cpu => (1.0, "GFLOP/s"),
        Device::Cuda(_) => (1e3, "TFLOP/s"),
    };
    let all = series(rows, per_unit);
    // Linear attention's FLOPs are not softmax attention's: beside it, times compare.
    if rows.iter().any(|r| r.linear.is_some()) {
        let y = "ms (log scale)";
        panel(&left, &all, "Time per call", y, true, |p| p.3, false)?;
    } else {
        panel(&left, &all, "Speed", unit, false, |p| p.1, false)?;
    }
    panel(
        &right,
        &all,
        "Extra memory (beyond inputs and outputs)",
        "MiB (log scale)",
        true,
        |p| p.2,
        true,
    )?;
    root.present()?;
    Ok(())
}

/// Writes the chart of `rows` to `path` (.png or .svg), atomically.
pub fn write(path: &Path, rows: &[Row]) -> CliResult<()> {
    if rows.is_empty() {
        return Err(fail("--plot: nothing was measured"));
    }
    register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| fail("the embedded font could not be read"))?;
    let err = |e: Box<dyn std::error::Error>| fail(format!("--plot {}: {e}", path.display()));
    match format_of(path)? {
        Format::Png => {
            let mut rgb = vec![0u8; (SIZE.0 * SIZE.1 * 3) as usize];
            draw(
                BitMapBackend::with_buffer(&mut rgb, SIZE).into_drawing_area(),
                rows,
            )
            .map_err(err)?;
            let mut png_bytes = Vec::new();
            let mut enc = png::Encoder::new(&mut png_bytes, SIZE.0, SIZE.1);
            enc.set_color(png::ColorType::Rgb);
            enc.set_depth(png::BitDepth::Eight);
            let mut w = enc.write_header().map_err(|e| fail(format!("png: {e}")))?;
            w.write_image_data(&rgb)
                .map_err(|e| fail(format!("png: {e}")))?;
            w.finish().map_err(|e| fail(format!("png: {e}")))?;
            write_bytes_atomic(path, &png_bytes)
        }
        Format::Svg => {
            let mut svg = String::new();
            draw(
                SVGBackend::with_string(&mut svg, SIZE).into_drawing_area(),
                rows,
            )
            .map_err(err)?;
            write_bytes_atomic(path, svg.as_bytes())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::Pass;
    use crate::inputs::Config;
    use crate::timing::Extra;
    use flashattn::Device;

    fn row(n: usize, standard: Outcome) -> Row {
        Row {
            pass: Pass::Forward,
            config: Config::new(1, 8, n, 64),
            device: Device::Cpu,
            flash: Measurement {
                time_ms: 1.0,
                gflops: 100.0,
                extra: Extra::Measured(200 << 10),
            },
            standard_device: Device::Cpu,
            standard,
            linear: None,
            gemm_percent: None,
            gemm_ceiling: None,
        }
    }

    #[test]
    fn chart_has_titles_legend_and_the_skip_note() {
        let std_run = Outcome::Ran(Measurement {
            time_ms: 3.0,
            gflops: 40.0,
            extra: Extra::Measured(64 << 20),
        });
        let rows = vec![
            row(1024, std_run.clone()),
            row(2048, std_run),
            row(32768, Outcome::Skipped("needs 32.5 GiB".into())),
        ];
        assert!(register_font("sans-serif", FontStyle::Normal, FONT).is_ok());
        let mut svg = String::new();
        draw(
            SVGBackend::with_string(&mut svg, SIZE).into_drawing_area(),
            &rows,
        )
        .unwrap();
        for text in [
            "Speed",
            "Extra memory",
            "flashattn forward full D=64 f32",
            "standard forward full D=64 f32",
            "N=32768 (needs 32.5 GiB)",
            "32768",
        ] {
            assert!(svg.contains(text), "`{text}` missing from the chart");
        }
    }

    #[test]
    fn each_layout_is_a_line_of_its_own() {
        let skipped = || Outcome::Skipped("--no-standard".into());
        let mut rows = vec![row(512, skipped()), row(1024, skipped())];
        for n in [512, 1024] {
            let mut r = row(n, skipped());
            r.config = r.config.layout(Layout::Bhnd);
            rows.push(r);
        }
        let lines: Vec<(String, usize)> = series(&rows, 1.0)
            .iter()
            .filter(|s| s.label.starts_with("flashattn"))
            .map(|s| (s.label.clone(), s.points.len()))
            .collect();
        assert_eq!(
            lines,
            [
                ("flashattn forward full D=64 f32 bnhd".to_string(), 2),
                ("flashattn forward full D=64 f32 bhnd".to_string(), 2)
            ]
        );
        // The default layout alone keeps the labels it had.
        let one = series(&rows[..2], 1.0);
        assert_eq!(one[0].label, "flashattn forward full D=64 f32");
    }
}
