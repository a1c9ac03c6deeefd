//! `plot`: PNG charts from the JSON reports of `forward` and `e2e`.
//!
//! - `<name>_verify_latency.png` per forward report: forward latency vs tokens in the pass
//!   (chains as lines, trees as triangles), one colour per context length;
//! - `<name>_toks_vs_k.png` per e2e report: tok/s vs chain depth K per drafter and pipeline,
//!   with the target-only rate as a flat line;
//! - `speedup_vs_beta.png` when the synthetic reports hold several β: speedup vs β.
//!
//! Labels need a TrueType font, read at run time (`--font`, else DejaVu/Liberation Sans from
//! the usual system paths); without one the charts are drawn without text.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use plotters::prelude::*;
use serde_json::Value;

/// Font files tried when `--font` is not given.
const FONT_CANDIDATES: [&str; 6] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/liberation2/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
];

/// Registers a sans-serif font; returns whether text can be drawn.
fn load_font(font: Option<&Path>) -> bool {
    let paths: Vec<PathBuf> = match font {
        Some(p) => vec![p.to_path_buf()],
        None => FONT_CANDIDATES.iter().map(PathBuf::from).collect(),
    };
    for p in paths {
        if let Ok(bytes) = std::fs::read(&p) {
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                return true;
            }
        }
    }
    eprintln!("no usable font found: drawing charts without text (pass --font FILE.ttf)");
    false
}

/// How a series is drawn.
#[derive(Clone, Copy, PartialEq)]
enum Style {
    /// Line through circles.
    Line,
    /// Triangles only.
    Points,
    /// A thin line without markers.
    Flat,
}

struct Series {
    name: String,
    points: Vec<(f64, f64)>,
    style: Style,
}

struct Chart<'a> {
    path: PathBuf,
    title: &'a str,
    x_desc: &'a str,
    y_desc: &'a str,
}

fn bounds(series: &[Series]) -> (f64, f64, f64) {
    let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let (mut x0, mut x1) = (f64::INFINITY, f64::NEG_INFINITY);
    for x in xs {
        x0 = x0.min(x);
        x1 = x1.max(x);
    }
    if !x0.is_finite() {
        (x0, x1) = (0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let y1 = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0f64, f64::max);
    (x0, x1, if y1 > 0.0 { y1 * 1.1 } else { 1.0 })
}

fn draw(c: &Chart, series: &[Series], text: bool) -> Result<()> {
    let (x0, x1, y1) = bounds(series);
    let pad = (x1 - x0) * 0.03;
    let root = BitMapBackend::new(&c.path, (1000, 640)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut b = ChartBuilder::on(&root);
    b.margin(20);
    if text {
        b.caption(c.title, ("sans-serif", 24))
            .x_label_area_size(45)
            .y_label_area_size(70);
    } else {
        // Label areas without labels still carry the axis lines.
        b.x_label_area_size(5).y_label_area_size(5);
    }
    let mut chart = b.build_cartesian_2d((x0 - pad)..(x1 + pad), 0f64..y1)?;
    if text {
        chart
            .configure_mesh()
            .x_desc(c.x_desc)
            .y_desc(c.y_desc)
            .label_style(("sans-serif", 15))
            .draw()?;
    } else {
        chart.configure_mesh().x_labels(0).y_labels(0).draw()?;
    }
    for (i, s) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let drawn = match s.style {
            Style::Line => {
                chart.draw_series(PointSeries::of_element(
                    s.points.clone(),
                    4,
                    color.filled(),
                    &|c, s, st| Circle::new(c, s, st),
                ))?;
                chart.draw_series(LineSeries::new(s.points.clone(), color.stroke_width(2)))?
            }
            Style::Points => chart.draw_series(PointSeries::of_element(
                s.points.clone(),
                7,
                color.filled(),
                &|c, s, st| TriangleMarker::new(c, s, st),
            ))?,
            Style::Flat => {
                chart.draw_series(LineSeries::new(s.points.clone(), BLACK.stroke_width(1)))?
            }
        };
        if text {
            let style = s.style;
            drawn.label(&s.name).legend(move |(x, y)| match style {
                Style::Points => TriangleMarker::new((x + 10, y), 6, color.filled()).into_dyn(),
                Style::Flat => PathElement::new(vec![(x, y), (x + 20, y)], BLACK).into_dyn(),
                Style::Line => {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)).into_dyn()
                }
            });
        }
    }
    if text && !series.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()?;
    }
    root.present()?;
    eprintln!("wrote {}", c.path.display());
    Ok(())
}

fn f(v: &Value, k: &str) -> f64 {
    v.get(k).and_then(Value::as_f64).unwrap_or(0.0)
}

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v.get(k).and_then(Value::as_str).unwrap_or("")
}

fn rows(doc: &Value) -> &[Value] {
    doc.get("rows")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

/// Forward latency vs tokens per pass, per context.
fn forward_chart(doc: &Value, stem: &str, out: &Path, text: bool) -> Result<()> {
    let mut by: BTreeMap<(u64, String), Vec<(f64, f64)>> = BTreeMap::new();
    for r in rows(doc) {
        let kind = s(r, "kind");
        if kind == "chain" || kind == "tree" || kind == "decode" {
            let kind = if kind == "decode" { "chain" } else { kind };
            by.entry((f(r, "context") as u64, kind.to_string()))
                .or_default()
                .push((f(r, "tokens"), f(r, "median_ms")));
        }
    }
    let series: Vec<Series> = by
        .into_iter()
        .map(|((ctx, kind), mut points)| {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            Series {
                name: format!("{kind}, context {ctx}"),
                points,
                style: if kind == "tree" {
                    Style::Points
                } else {
                    Style::Line
                },
            }
        })
        .collect();
    let meta = &doc["meta"];
    let title = format!(
        "Forward latency: {} on {} ({})",
        s(meta, "model"),
        s(meta, "device"),
        s(meta, "dtype")
    );
    let c = Chart {
        path: out.join(format!("{stem}_verify_latency.png")),
        title: &title,
        x_desc: "tokens in the pass (1 = decode; chain length K or tree size N)",
        y_desc: "median latency (ms)",
    };
    draw(&c, &series, text)
}

fn drafter_label(r: &Value) -> String {
    match (
        r.get("beta").and_then(Value::as_f64),
        r.get("drafter_choice").and_then(Value::as_str),
    ) {
        (Some(b), _) => format!("synthetic β={b}"),
        // ngram, suffix or auto (rows of `e2e --drafters`).
        (None, Some(c)) if c != "model" => c.to_string(),
        (None, _) => "real draft".into(),
    }
}

/// tok/s vs chain depth K per drafter and pipeline, plus the target-only rate.
fn toks_chart(doc: &Value, stem: &str, out: &Path, text: bool) -> Result<()> {
    let mut by: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    let mut ar = None;
    let mut kmax = 1.0f64;
    for r in rows(doc) {
        match s(r, "kind") {
            "ar" => ar = Some(f(r, "tok_per_s")),
            "chain" => {
                let name = format!("{}, {}", drafter_label(r), s(r, "pipeline"));
                kmax = kmax.max(f(r, "depth"));
                by.entry(name)
                    .or_default()
                    .push((f(r, "depth"), f(r, "tok_per_s")));
            }
            _ => {}
        }
    }
    let mut series: Vec<Series> = by
        .into_iter()
        .map(|(name, mut points)| {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            Series {
                name,
                points,
                style: Style::Line,
            }
        })
        .collect();
    if let Some(t) = ar {
        series.push(Series {
            name: format!("target-only ({t:.1} tok/s)"),
            points: vec![(1.0, t), (kmax, t)],
            style: Style::Flat,
        });
    }
    let meta = &doc["meta"];
    let title = format!(
        "Throughput vs draft depth: {} / {}",
        s(meta, "target"),
        s(meta, "draft")
    );
    let c = Chart {
        path: out.join(format!("{stem}_toks_vs_k.png")),
        title: &title,
        x_desc: "chain depth K",
        y_desc: "tokens per second",
    };
    draw(&c, &series, text)
}

/// Speedup vs β over all synthetic chain rows: best depth per pipeline, and each depth.
fn beta_chart(docs: &[(String, Value)], out: &Path, text: bool) -> Result<bool> {
    let mut best: BTreeMap<String, BTreeMap<u64, f64>> = BTreeMap::new();
    let mut each: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    let mut betas: Vec<u64> = Vec::new();
    for (_, doc) in docs {
        for r in rows(doc) {
            let Some(beta) = r.get("beta").and_then(Value::as_f64) else {
                continue;
            };
            if s(r, "kind") != "chain" {
                continue;
            }
            let key = (beta * 1e6).round() as u64;
            if !betas.contains(&key) {
                betas.push(key);
            }
            let pipe = s(r, "pipeline").to_string();
            let e = best
                .entry(format!("best depth, {pipe}"))
                .or_default()
                .entry(key)
                .or_insert(0.0);
            *e = e.max(f(r, "speedup"));
            each.entry(format!("K={}, {pipe}", f(r, "depth")))
                .or_default()
                .push((beta, f(r, "speedup")));
        }
    }
    if betas.len() < 2 {
        return Ok(false);
    }
    let mut series: Vec<Series> = best
        .into_iter()
        .map(|(name, m)| Series {
            name,
            points: m.into_iter().map(|(k, v)| (k as f64 / 1e6, v)).collect(),
            style: Style::Line,
        })
        .collect();
    series.extend(each.into_iter().map(|(name, mut points)| {
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        Series {
            name,
            points,
            style: Style::Points,
        }
    }));
    let c = Chart {
        path: out.join("speedup_vs_beta.png"),
        title: "Speedup over target-only vs synthetic acceptance β (synthetic drafter)",
        x_desc: "β (per-token acceptance of the synthetic drafter)",
        y_desc: "speedup (×)",
    };
    draw(&c, &series, text)?;
    Ok(true)
}

/// Draws every chart the reports in `input` allow into `out`.
pub fn run(input: &Path, out: &Path, font: Option<&Path>) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut entries: Vec<PathBuf> = std::fs::read_dir(input)
        .with_context(|| format!("reading {}", input.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    entries.sort();
    let mut docs: Vec<(String, Value)> = Vec::new();
    for p in entries {
        let text = std::fs::read_to_string(&p)?;
        match serde_json::from_str::<Value>(&text) {
            Ok(v) if v["meta"]["kind"].is_string() => {
                let stem = p
                    .file_stem()
                    .map(|x| x.to_string_lossy().into_owned())
                    .unwrap_or_default();
                docs.push((stem, v));
            }
            _ => eprintln!("skipping {} (not a bench report)", p.display()),
        }
    }
    if docs.is_empty() {
        anyhow::bail!("no bench reports (*.json) in {}", input.display());
    }
    let text = load_font(font);
    let mut n = 0;
    for (stem, doc) in &docs {
        match doc["meta"]["kind"].as_str() {
            Some("forward") => forward_chart(doc, stem, out, text)?,
            Some("e2e") => toks_chart(doc, stem, out, text)?,
            _ => continue,
        }
        n += 1;
    }
    let e2e: Vec<(String, Value)> = docs
        .into_iter()
        .filter(|(_, d)| d["meta"]["kind"] == "e2e")
        .collect();
    if beta_chart(&e2e, out, text)? {
        n += 1;
    }
    eprintln!("{n} charts");
    Ok(())
}
