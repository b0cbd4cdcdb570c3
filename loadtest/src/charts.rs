//! The charts of a run, as SVG: throughput per scenario against nginx, the latency percentiles
//! at the fixed rate, and the CPU per request of each process. Every run writes them to
//! `loadtest/out/`; a full run (neither `--quick` nor `--only`) also to `loadtest/charts/`, which
//! the README shows. The `charts` subcommand draws them from a run's printed output instead.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use plotters::coord::ranged1d::{AsRangedCoord, Ranged, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::bench::{human, Bench};
use crate::load::CpuPerRequest;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// What the charts show of one row of the results.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub name: String,
    pub body: usize,
    /// Closed loop, the median round.
    pub rps: f64,
    pub cpu: Option<CpuPerRequest>,
    /// Latency at the fixed rate: the percentiles the data has, in ms (a run has p50 to
    /// p99.9, its printed table p50 and p99).
    pub at_rate: Option<Vec<(&'static str, f64)>>,
}

/// Which run the charts show, for their titles.
#[derive(Debug, Clone)]
pub struct Run {
    pub cores: usize,
    pub date: String,
    pub command: String,
    /// Of the closed-loop phases.
    pub connections: usize,
    /// The main table's fixed rate for each body size, req/s.
    pub rates: Vec<(usize, f64)>,
}

/// The percentiles a run's own reports give at the fixed rate.
const PERCENTILES: [(&str, f64); 4] = [("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p99.9", 0.999)];

/// Each chart, and its file.
const CHARTS: [(&str, Chart); 3] = [
    ("throughput.svg", throughput),
    ("latency.svg", latency),
    ("cpu.svg", cpu),
];
type Chart = fn(&Run, &[Scenario]) -> Result<String>;

/// After a run: its charts to `loadtest/out/`, and with `full` to `loadtest/charts/` too.
pub fn after_run(b: &Bench, full: bool) {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (run, scenarios) = (this_run(b), from_bench(b));
    let dirs = [Some(here.join("out")), full.then(|| here.join("charts"))];
    for dir in dirs.into_iter().flatten() {
        match write(&dir, &run, &scenarios) {
            Ok(()) => eprintln!("charts: {}", dir.display()),
            Err(e) => eprintln!("charts: not written to {}: {e}", dir.display()),
        }
    }
}

/// The run this process made: this machine, today, its command line.
fn this_run(b: &Bench) -> Run {
    let args: Vec<String> = std::env::args().skip(1).collect();
    Run {
        cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
        date: today(),
        command: format!("loadtest/run {}", args.join(" "))
            .trim_end()
            .to_string(),
        connections: b.connections,
        rates: b.notes.iter().filter_map(|n| rate_note(n)).collect(),
    }
}

/// The `charts` subcommand: the charts of a run from its printed output.
#[derive(clap::Args)]
pub struct FromOutput {
    /// The run's output, as `loadtest/run` printed it (e.g. loadtest/last-full-run.txt).
    file: PathBuf,
    /// Where to write the SVG files.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/out"))]
    out: PathBuf,
    /// The date of the run, for an output without the `==> date:` line.
    #[arg(long)]
    date: Option<String>,
    /// The command that made the run.
    #[arg(long, default_value = "loadtest/run")]
    command: String,
}

/// Draw the charts of [`FromOutput`]'s file.
pub fn from_output(args: FromOutput) -> ExitCode {
    let text = match std::fs::read_to_string(&args.file) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{}: {e}", args.file.display());
            return ExitCode::FAILURE;
        }
    };
    let (mut run, scenarios) = parse(&text);
    run.command = args.command;
    if let Some(d) = args.date {
        run.date = d;
    }
    if run.date.is_empty() || scenarios.is_empty() {
        eprintln!(
            "{}: no date (give --date) or no results table",
            args.file.display()
        );
        return ExitCode::FAILURE;
    }
    match write(&args.out, &run, &scenarios) {
        Ok(()) => {
            eprintln!(
                "charts: {} scenarios to {}",
                scenarios.len(),
                args.out.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("charts: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The rows of a run, as the charts show them.
pub fn from_bench(b: &Bench) -> Vec<Scenario> {
    b.rows
        .iter()
        .map(|row| Scenario {
            name: row.scenario.clone(),
            body: row.body,
            rps: row.closed.rps(),
            cpu: row.closed.cpu,
            at_rate: (row.at_rate.as_ref())
                .map(|r| PERCENTILES.iter().map(|&(p, q)| (p, r.ms(q))).collect()),
        })
        .collect()
}

/// The results of a run's printed output (`table::print`'s table, its CPU lines and the fixed
/// rates), and what it says of the run (cores, date, connections; the command left empty).
pub fn parse(text: &str) -> (Run, Vec<Scenario>) {
    let mut run = Run {
        cores: 0,
        date: String::new(),
        command: String::new(),
        connections: 0,
        rates: Vec::new(),
    };
    // Each row's latency at the fixed rate as printed: p50 and p99.
    let mut printed: Vec<(String, String)> = Vec::new();
    let mut scenarios: Vec<Scenario> = Vec::new();
    for line in text.lines() {
        if let Some(m) = line.strip_prefix("==> machine: ") {
            run.cores = m
                .split(" cores")
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
        } else if let Some(d) = line.strip_prefix("==> date: ") {
            run.date = d.split_whitespace().next().unwrap_or("").to_string();
        } else if line.starts_with("idemgate loadtest: ") {
            let before = line.split(" connections").next().unwrap_or("");
            run.connections = before
                .rsplit(' ')
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
        } else if let Some(row) = table_row(line) {
            printed.push((row.1, row.2));
            scenarios.push(row.0);
        } else if let Some((name, body, cpu)) = cpu_line(line) {
            if let Some(s) = scenarios
                .iter_mut()
                .find(|s| s.name == name && s.body == body)
            {
                s.cpu = Some(cpu);
            }
        } else if let Some(rate) = line.strip_prefix("- ").and_then(rate_note) {
            run.rates.push(rate);
        }
    }
    at_rate(&mut scenarios, &printed);
    (run, scenarios)
}

/// Each scenario's latency at the fixed rate from its `printed` p50 and p99: added to direct's
/// of its body size, or in brackets its own.
fn at_rate(scenarios: &mut [Scenario], printed: &[(String, String)]) {
    let own = |s: &str| s.strip_prefix('(')?.strip_suffix(')')?.parse::<f64>().ok();
    let direct: HashMap<usize, (f64, f64)> = scenarios
        .iter()
        .zip(printed)
        .filter(|(s, _)| s.name == "direct to upstream")
        .filter_map(|(s, (p50, p99))| Some((s.body, (own(p50)?, own(p99)?))))
        .collect();
    for (s, (p50, p99)) in scenarios.iter_mut().zip(printed) {
        let absolute = |v: &str, i: usize| match own(v) {
            Some(ms) => Some(ms),
            None => {
                let base = direct.get(&s.body)?;
                Some([base.0, base.1][i] + v.parse::<f64>().ok()?)
            }
        };
        if let (Some(a), Some(b)) = (absolute(p50, 0), absolute(p99, 1)) {
            s.at_rate = Some(vec![("p50", a), ("p99", b)]);
        }
    }
}

/// A row of the printed table: the scenario, and its added p50 and p99 at the fixed rate as
/// printed.
fn table_row(line: &str) -> Option<(Scenario, String, String)> {
    let cells: Vec<&str> = line
        .strip_prefix('|')?
        .strip_suffix('|')?
        .split('|')
        .map(str::trim)
        .collect();
    if cells.len() != 12 || cells[0] == "scenario" || cells[0].starts_with("---") {
        return None;
    }
    let s = Scenario {
        name: cells[0].to_string(),
        body: size(cells[1])?,
        rps: cells[2].parse().ok()?,
        cpu: None,
        at_rate: None,
    };
    Some((s, cells[7].to_string(), cells[8].to_string()))
}

/// `- {scenario}, {body}: proxy + upstream + Redis + load = all`.
fn cpu_line(line: &str) -> Option<(String, usize, CpuPerRequest)> {
    let (what, sum) = line.strip_prefix("- ")?.rsplit_once(": ")?;
    let (name, body) = what.rsplit_once(", ")?;
    let parts: Vec<f64> = sum
        .split(" = ")
        .next()?
        .split(" + ")
        .map(|p| p.parse().ok())
        .collect::<Option<_>>()?;
    let [proxy, upstream, redis, load] = parts[..] else {
        return None;
    };
    Some((
        name.to_string(),
        size(body)?,
        CpuPerRequest {
            proxy,
            upstream,
            redis,
            load,
        },
    ))
}

/// `{body} body: fixed rate {rate} req/s ...`, the main table's note.
fn rate_note(note: &str) -> Option<(usize, f64)> {
    let (body, rest) = note.split_once(" body: fixed rate ")?;
    Some((size(body)?, rest.split(' ').next()?.parse().ok()?))
}

/// The inverse of [`human`]: `1 KiB`, `64 KiB`, `1069 B`.
fn size(s: &str) -> Option<usize> {
    let (n, unit) = s.split_once(' ')?;
    let n: usize = n.parse().ok()?;
    match unit {
        "KiB" => Some(n * 1024),
        "B" => Some(n),
        _ => None,
    }
}

/// Write the three charts of `scenarios` into `dir` (created).
pub fn write(dir: &Path, run: &Run, scenarios: &[Scenario]) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    for (file, chart) in CHARTS {
        std::fs::write(dir.join(file), chart(run, scenarios)?)?;
    }
    Ok(())
}

// === The charts ===

const GATEWAY: RGBColor = RGBColor(0x2b, 0x6c, 0xb0);
const NGINX: RGBColor = RGBColor(0xe0, 0x7b, 0x16);
const OTHER: RGBColor = RGBColor(0x9a, 0x9a, 0x9a);
const UPSTREAM: RGBColor = RGBColor(0x4c, 0xa0, 0x5a);
const STORE: RGBColor = RGBColor(0xc0, 0x40, 0x40);
const LOAD: RGBColor = RGBColor(0x8e, 0x6c, 0xb8);
/// p50, p90, p99, p99.9: lighter to darker.
const SHADES: [RGBColor; 4] = [
    RGBColor(0x9e, 0xca, 0xe1),
    RGBColor(0x6b, 0xae, 0xd6),
    RGBColor(0x31, 0x82, 0xbd),
    RGBColor(0x08, 0x45, 0x94),
];
/// Text sizes as plotters takes them (the SVG's are 1.24 times smaller: 13 and 19 px).
const TEXT: f64 = 16.0;
const TITLE: f64 = 24.0;
/// What a character of `TEXT` takes across, about, in pixels.
const CHAR: u32 = 7;
const WIDTH: u32 = 1200;
/// Above the plot: the title, the subtitle and the legend.
const HEAD: u32 = 100;
/// Below it: the x axis, its labels and its title.
const FOOT: u32 = 60;
/// The height of a row with one bar.
const ROW: u32 = 26;

/// Whose bar: the gateway's, nginx's (the reference) or another (direct, the axum app, pgbench,
/// the duplicate storm).
fn colour(name: &str) -> RGBColor {
    if name.starts_with("nginx") {
        NGINX
    } else if name.contains("gateway") {
        GATEWAY
    } else {
        OTHER
    }
}

/// The nginx row a gateway row is compared with, when its section has one: the nearest before
/// it of the same body size, with no direct row between. An nginx row with a qualifier
/// (`nginx proxy, https upstream`, `nginx proxy, beside postgres`) is the reference of the
/// gateway rows naming it (`https upstream`, `postgres`), whatever rows lie between (pgbench's);
/// the main table's plain `nginx proxy`, of the gateway rows right after it.
fn reference(s: &[Scenario], i: usize) -> Option<usize> {
    if !s[i].name.starts_with("gateway") {
        return None;
    }
    let mut between_others = false;
    for j in (0..i).rev() {
        if s[j].body != s[i].body || s[j].name == "direct to upstream" {
            return None;
        }
        if let Some(q) = s[j].name.strip_prefix("nginx proxy") {
            let q = q.trim_start_matches(", ").trim_start_matches("beside ");
            let named = if q.is_empty() {
                !between_others
            } else {
                s[i].name.contains(q)
            };
            return named.then_some(j);
        }
        between_others |= !s[j].name.starts_with("gateway");
    }
    None
}

/// Whether row `i` starts a new group in the charts (a line is drawn above it): another body
/// size, direct, an nginx row of its own section, or another kind of scenario (the axum app,
/// the cluster's gateways, the storm).
fn starts_group(rows: &[&Scenario], i: usize) -> bool {
    fn kind(s: &Scenario) -> &str {
        match s.name.split(|c: char| !c.is_alphanumeric()).next() {
            Some("direct" | "nginx" | "gateway" | "pgbench") => "proxy",
            word => word.unwrap_or(""),
        }
    }
    let (a, b) = (rows[i - 1], rows[i]);
    a.body != b.body
        || b.name == "direct to upstream"
        || (b.name.starts_with("nginx") && a.name != "direct to upstream")
        || kind(a) != kind(b)
}

/// `scenario · 1 KiB`.
fn label(s: &Scenario) -> String {
    format!("{} · {}", s.name, human(s.body))
}

/// Horizontal bars of closed-loop req/s, nginx's distinct, each gateway bar with its ratio to
/// the nginx of its section.
fn throughput(run: &Run, s: &[Scenario]) -> Result<String> {
    let rows: Vec<&Scenario> = s.iter().collect();
    let mut svg = String::new();
    {
        let size = (WIDTH, HEAD + FOOT + ROW * rows.len() as u32);
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        let max = s.iter().map(|x| x.rps).fold(1.0, f64::max);
        let legend = [
            (GATEWAY, "the idemgate gateway"),
            (NGINX, "nginx (the reference)"),
            (
                OTHER,
                "others: direct to the upstream, the axum app, pgbench, the storm",
            ),
        ];
        let head = Head {
            title: format!("Throughput per scenario: {} cores, {}", run.cores, run.date),
            subtitle: format!(
                "closed loop, {} connections, the median round; × nginx: the ratio to the nginx of the same section and body size; {}",
                run.connections, run.command
            ),
            legend: &legend,
        };
        let axis = Axis {
            title: "requests per second",
            labels: 10,
            format: tick,
        };
        let chart = frame(&root, &head, (&rows, label), (0.0..max * 1.3, axis))?;
        for (i, r) in s.iter().enumerate() {
            let y = band(s.len(), i);
            let area = chart.plotting_area();
            area.draw(&bar((0.0, y.0), (r.rps, y.1), colour(&r.name), 4))?;
            let note = match (r.name.starts_with("nginx"), reference(s, i)) {
                (true, _) => format!("{:.0} (reference)", r.rps),
                (_, Some(j)) => format!("{:.0} · {:.2} × nginx", r.rps, r.rps / s[j].rps),
                _ => format!("{:.0}", r.rps),
            };
            after_bar(area, &note, (r.rps, (y.0 + y.1) / 2.0))?;
        }
        root.present()?;
    }
    Ok(svg)
}

/// For each scenario measured at the fixed rate, a bar per percentile (log scale).
fn latency(run: &Run, s: &[Scenario]) -> Result<String> {
    let rows: Vec<(&Scenario, &[(&str, f64)])> = s
        .iter()
        .filter_map(|x| Some((x, x.at_rate.as_deref()?)))
        .collect();
    let per = rows.iter().map(|(_, ms)| ms.len()).max().unwrap_or(1) as u32;
    let all: Vec<f64> = rows
        .iter()
        .flat_map(|(_, ms)| ms.iter().map(|m| m.1))
        .collect();
    // Whole powers of ten around every value.
    let lo = 10f64.powf(
        all.iter()
            .fold(1.0, |a, &b| b.min(a))
            .max(0.001)
            .log10()
            .floor(),
    );
    let hi = 10f64.powf(all.iter().fold(1.0, |a, &b| b.max(a)).log10().ceil() + 0.2);
    let names: Vec<&str> = rows
        .first()
        .map_or(vec![], |(_, ms)| ms.iter().map(|m| m.0).collect());
    let legend: Vec<(RGBColor, &str)> = names.iter().zip(SHADES).map(|(n, c)| (c, *n)).collect();
    let rates: Vec<String> = run
        .rates
        .iter()
        .map(|(body, r)| format!("{r:.0} req/s at {}", human(*body)))
        .collect();
    let head = Head {
        title: format!("Latency at the fixed rate: {} cores, {}", run.cores, run.date),
        subtitle: format!(
            "open loop, 32 connections, one rate for all of a body size (half the slowest maximum: {}); {}",
            rates.join(", "),
            run.command
        ),
        legend: &legend,
    };
    let mut svg = String::new();
    {
        let size = (
            WIDTH,
            HEAD + FOOT + (8 + 11 * per) * rows.len().max(1) as u32,
        );
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        // A little below `lo`, so that its own line and label are drawn; a label count that
        // gives each power of ten its nine lines.
        let decades = (hi / lo).log10().ceil() as usize;
        let axis = Axis {
            title: "latency, ms (log scale)",
            labels: 10 * decades + 1,
            format: log_tick,
        };
        let bands: Vec<&Scenario> = rows.iter().map(|r| r.0).collect();
        let chart = frame(
            &root,
            &head,
            (&bands, label),
            ((lo * 0.99..hi).log_scale(), axis),
        )?;
        for (i, (_, ms)) in rows.iter().enumerate() {
            let (y0, y1) = band(rows.len(), i);
            // A tenth of the band apart from the next; the first percentile at the top.
            let step = (y1 - y0 - 0.2) / ms.len() as f64;
            for (k, &(_, v)) in ms.iter().enumerate() {
                let top = y1 - 0.1 - step * k as f64;
                let shade = SHADES[k.min(SHADES.len() - 1)];
                chart
                    .plotting_area()
                    .draw(&bar((lo, top - step), (v, top), shade, 1))?;
                after_bar(
                    chart.plotting_area(),
                    &format!("{v:.2}"),
                    (v, top - step / 2.0),
                )?;
            }
        }
        root.present()?;
    }
    Ok(svg)
}

/// CPU time per request of each process, stacked: the proxy (coloured as in the throughput
/// chart), the upstream, Redis (or PostgreSQL) and the load generator (or pgbench).
fn cpu(run: &Run, s: &[Scenario]) -> Result<String> {
    let rows: Vec<&Scenario> = s
        .iter()
        .filter(|x| x.cpu.is_some_and(|c| c.all() > 0.0))
        .collect();
    let mut svg = String::new();
    {
        let size = (WIDTH, HEAD + FOOT + ROW * rows.len().max(1) as u32);
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        let max = rows
            .iter()
            .filter_map(|x| x.cpu)
            .map(|c| c.all())
            .fold(1.0, f64::max);
        let legend = [
            (GATEWAY, "the gateway"),
            (NGINX, "nginx"),
            (OTHER, "the axum app (alone or with the layer)"),
            (UPSTREAM, "the upstream"),
            (STORE, "Redis (PostgreSQL in its section)"),
            (LOAD, "the load generator (or pgbench)"),
        ];
        let head = Head {
            title: format!("CPU time per request, by process: {} cores, {}", run.cores, run.date),
            subtitle: format!(
                "closed loop, the median round, from the scheduler's accounting of each process; {}",
                run.command
            ),
            legend: &legend,
        };
        let axis = Axis {
            title: "CPU time per request, µs",
            labels: 10,
            format: tick,
        };
        let chart = frame(&root, &head, (&rows, label), (0.0..max * 1.15, axis))?;
        for (i, r) in rows.iter().enumerate() {
            let (y, c) = (band(rows.len(), i), r.cpu.unwrap_or_default());
            let parts = [
                (c.proxy, colour(&r.name)),
                (c.upstream, UPSTREAM),
                (c.redis, STORE),
                (c.load, LOAD),
            ];
            let mut from = 0.0;
            for (us, shade) in parts {
                chart
                    .plotting_area()
                    .draw(&bar((from, y.0), (from + us, y.1), shade, 4))?;
                from += us;
            }
            after_bar(
                chart.plotting_area(),
                &format!("{:.1}", c.all()),
                (from, (y.0 + y.1) / 2.0),
            )?;
        }
        root.present()?;
    }
    Ok(svg)
}

// === The frame they share ===

/// What is written above a chart.
struct Head<'a> {
    title: String,
    subtitle: String,
    legend: &'a [(RGBColor, &'a str)],
}

/// The x axis: its title, about how many values it labels, and how.
struct Axis {
    title: &'static str,
    labels: usize,
    format: fn(f64) -> String,
}

/// Row `i` of `n` (the first at the top) spans this y range.
fn band(n: usize, i: usize) -> (f64, f64) {
    ((n - 1 - i) as f64, (n - i) as f64)
}

/// A filled bar from `a` to `b`, `gap` pixels short of its band's edges.
fn bar(a: (f64, f64), b: (f64, f64), colour: RGBColor, gap: u32) -> Rectangle<(f64, f64)> {
    let mut r = Rectangle::new([a, b], colour.filled());
    r.set_margin(gap, gap, 0, 0);
    r
}

/// A value written just after the end of a bar.
fn after_bar<X: Ranged<ValueType = f64>>(
    area: &DrawingArea<SVGBackend, Cartesian2d<X, RangedCoordf64>>,
    text: &str,
    at: (f64, f64),
) -> Result<()> {
    let style =
        TextStyle::from(("sans-serif", TEXT).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    area.draw(&(EmptyElement::at(at) + Text::new(text.to_string(), (5, 0), style)))?;
    Ok(())
}

/// The head, one band per row down the left (its label written beside it, a line above each
/// group) and the x axis `x` with its title; the y axis runs over the bands, 0 to `rows.len()`.
fn frame<'a, 'b, X>(
    root: &'a DrawingArea<SVGBackend<'b>, Shift>,
    head: &Head,
    (rows, label): (&[&Scenario], impl Fn(&Scenario) -> String),
    (x, axis): (X, Axis),
) -> Result<ChartContext<'a, SVGBackend<'b>, Cartesian2d<X::CoordDescType, RangedCoordf64>>>
where
    X: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
{
    root.fill(&WHITE)?;
    let text = ("sans-serif", TEXT).into_font();
    let bold = ("sans-serif", TITLE).into_font().style(FontStyle::Bold);
    root.draw(&Text::new(head.title.clone(), (20, 14), bold))?;
    let grey = text.clone().color(&RGBColor(0x50, 0x50, 0x50));
    root.draw(&Text::new(head.subtitle.clone(), (20, 46), grey))?;
    let beside = TextStyle::from(text.clone()).pos(Pos::new(HPos::Left, VPos::Center));
    let mut at = 20;
    for (shade, name) in head.legend {
        root.draw(&Rectangle::new([(at, 72), (at + 14, 86)], shade.filled()))?;
        root.draw(&Text::new(name.to_string(), (at + 20, 79), beside.clone()))?;
        at += 20 + (CHAR * name.chars().count() as u32) as i32 + 24;
    }
    let labels: Vec<String> = rows.iter().map(|r| label(r)).collect();
    let left = 24 + CHAR * labels.iter().map(|l| l.chars().count()).max().unwrap_or(10) as u32;
    let mut chart = ChartBuilder::on(root)
        .margin_top(HEAD)
        .margin_right(30)
        .x_label_area_size(FOOT)
        .y_label_area_size(left)
        .build_cartesian_2d(x, 0.0..labels.len().max(1) as f64)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(0)
        .x_labels(axis.labels)
        .max_light_lines(1)
        .x_label_formatter(&|v| (axis.format)(*v))
        .x_desc(axis.title)
        .label_style(text.clone())
        .axis_desc_style(text.clone())
        .light_line_style(RGBColor(0xf0, 0xf0, 0xf0))
        .bold_line_style(RGBColor(0xdd, 0xdd, 0xdd))
        .draw()?;
    let right = TextStyle::from(text).pos(Pos::new(HPos::Right, VPos::Center));
    let (x0, x1) = (chart.x_range().start, chart.x_range().end);
    for (i, l) in labels.iter().enumerate() {
        let (y0, y1) = band(labels.len(), i);
        let (_, py) = chart.backend_coord(&(x0, (y0 + y1) / 2.0));
        root.draw(&Text::new(l.clone(), (left as i32 - 8, py), right.clone()))?;
        if i > 0 && starts_group(rows, i) {
            let line = PathElement::new(vec![(x0, y1), (x1, y1)], RGBColor(0x90, 0x90, 0x90));
            chart.plotting_area().draw(&line)?;
        }
    }
    Ok(chart)
}

/// An axis value: whole numbers without decimals, small ones with as few as they need.
fn tick(v: f64) -> String {
    if v >= 10.0 || v == v.round() {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// A log axis value: 1, 2 and 5 times a power of ten, the others' lines left unlabelled.
fn log_tick(v: f64) -> String {
    let lead = v / 10f64.powf(v.log10().floor());
    let lead = lead.round();
    if [1.0, 2.0, 5.0].contains(&lead) {
        tick(v)
    } else {
        String::new()
    }
}

/// Today's date (UTC), `YYYY-MM-DD`: the civil date of the days since 1970 (Howard Hinnant's
/// `civil_from_days`).
fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let z = (secs / 86400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use hdrhistogram::Histogram;

    use super::*;
    use crate::bench::Row;
    use crate::load::Report;

    /// A report of `rps` requests in one second, latencies `ms` (one request each), and CPU.
    fn report(rps: u64, ms: &[f64], cpu: Option<[f64; 4]>) -> Report {
        let mut hist = Histogram::new_with_bounds(1, 60_000_000, 3).unwrap();
        ms.iter()
            .for_each(|m| hist.record((m * 1000.0) as u64).unwrap());
        Report {
            requests: rps,
            ok: rps,
            conflicts: 0,
            errors: 0,
            elapsed: Duration::from_secs(1),
            hist,
            first_byte: Histogram::new_with_bounds(1, 60_000_000, 3).unwrap(),
            cpu: cpu.map(|[proxy, upstream, redis, load]| CpuPerRequest {
                proxy,
                upstream,
                redis,
                load,
            }),
        }
    }

    fn row(scenario: &str, rps: u64, at_rate: bool, cpu: Option<[f64; 4]>) -> Row {
        let closed = report(rps, &[1.0, 2.0, 4.0], cpu);
        Row {
            scenario: scenario.to_string(),
            body: 1024,
            samples: vec![closed.clone()],
            closed,
            at_rate: at_rate.then(|| report(500, &[0.2, 0.3, 0.9, 1.5, 7.0], None)),
        }
    }

    #[test]
    fn a_run_is_drawn_as_three_svg_charts_naming_every_scenario() {
        let mut b = Bench::new(Duration::from_secs(1), Duration::ZERO, 64, 1);
        b.rows = vec![
            row(
                "direct to upstream",
                90000,
                true,
                Some([0.0, 10.0, 0.0, 10.5]),
            ),
            row("nginx proxy", 50000, true, Some([17.8, 10.2, 0.0, 11.1])),
            row(
                "gateway miss, redis",
                25000,
                true,
                Some([36.8, 12.2, 14.2, 13.1]),
            ),
            row("axum app alone", 80000, false, Some([11.5, 0.0, 0.0, 11.9])),
            row("duplicate storm, memory", 70000, false, None),
        ];
        b.notes
            .push("1 KiB body: fixed rate 500 req/s (half the slowest maximum)".into());
        let run = Run {
            date: "2026-11-26".into(),
            command: "loadtest/run --quick".into(),
            ..this_run(&b)
        };
        assert_eq!(run.connections, 64);
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &run, &from_bench(&b)).unwrap();
        let read = |f: &str| std::fs::read_to_string(dir.path().join(f)).unwrap();
        let (throughput, latency, cpu) = (read(CHARTS[0].0), read(CHARTS[1].0), read(CHARTS[2].0));
        for svg in [&throughput, &latency, &cpu] {
            assert!(svg.starts_with("<svg"), "{svg}");
            assert!(svg.trim_end().ends_with("</svg>"));
            let title = format!("{} cores, 2026-11-26", run.cores);
            assert!(
                run.cores > 0 && svg.contains(&title),
                "the machine and the date"
            );
            assert!(svg.contains("loadtest/run --quick"));
        }
        for r in &b.rows {
            assert!(
                throughput.contains(&format!("{} · 1 KiB", r.scenario)),
                "{}",
                r.scenario
            );
        }
        assert!(throughput.contains("requests per second"));
        assert!(
            throughput.contains("25000 · 0.50 × nginx"),
            "the gateway against nginx"
        );
        assert!(throughput.contains("50000 (reference)"));
        assert!(
            !throughput.contains("80000 ·"),
            "no ratio for the app: {throughput}"
        );

        assert!(latency.contains("latency, ms (log scale)"));
        assert!(latency.contains("gateway miss, redis · 1 KiB"));
        assert!(latency.contains("500 req/s at 1 KiB"), "the fixed rate");
        assert!(
            !latency.contains("axum app alone"),
            "measured at no fixed rate"
        );
        for p in ["p50", "p90", "p99", "p99.9"] {
            assert!(latency.contains(&format!(">\n{p}\n<")), "{p}");
        }

        assert!(cpu.contains("CPU time per request, µs"));
        assert!(cpu.contains("gateway miss, redis · 1 KiB"));
        assert!(cpu.contains("76.3"), "the sum of the four processes");
        assert!(!cpu.contains("duplicate storm"), "no CPU measured");
    }

    #[test]
    fn the_printed_table_is_read_back() {
        let text = "\
==> machine: 2 cores, 24 GiB, Linux 6.18.44
==> date: 2026-11-26 22:18 UTC
idemgate loadtest: 5 s phases, 64 connections
| scenario | body | req/s (median of 3) | rounds req/s | p50 ms | p99 ms | p99.9 ms | added p50 ms @rate | added p99 ms @rate | proxy CPU µs/req | all CPU µs/req | 409s + errors |
|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|
| direct to upstream | 64 KiB | 35087 | 40694, 32186, 35087 | 1.60 | 5.53 | 8.56 | (0.189) | (1.488) | 0.0 | 53.1 | 0 |
| nginx proxy | 64 KiB | 21215 | 22078, 21215, 14480 | 2.84 | 7.85 | 10.73 | +0.196 | +0.538 | 37.3 | 88.7 | 0 |
| gateway pass-through (no key) | 64 KiB | 16602 | 18254, 14940, 16602 | 3.97 | 9.05 | 11.54 | +0.212 | -0.272 | 49.9 | 111.4 | 0 |
| pgbench, the miss's 2 statements (16 clients) | 1069 B | 6486 | 6486 | 1.98 | 9.97 | 20.77 |  |  | 0.0 | 255.2 | 0 |

CPU per request, µs (median round; proxy + upstream + Redis + load generator = all):
- nginx proxy, 64 KiB: 37.3 + 21.1 + 0.1 + 30.0 = 88.7
- pgbench, the miss's 2 statements (16 clients), 1069 B: 0.0 + 0.0 + 213.6 + 41.6 = 255.2

notes:
- 64 KiB body: fixed rate 3352 req/s (half the slowest maximum); gateway RSS after the phases
";
        let (run, s) = parse(text);
        assert_eq!(
            (run.cores, run.date.as_str(), run.connections),
            (2, "2026-11-26", 64)
        );
        assert_eq!(run.rates, [(65536, 3352.0)]);
        let names: Vec<&str> = s.iter().map(|x| x.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "direct to upstream",
                "nginx proxy",
                "gateway pass-through (no key)",
                "pgbench, the miss's 2 statements (16 clients)"
            ]
        );
        assert_eq!((s[0].body, s[3].body, s[1].rps), (65536, 1069, 21215.0));
        let cpu = s[1].cpu.unwrap();
        assert_eq!(
            (cpu.proxy, cpu.upstream, cpu.redis, cpu.load),
            (37.3, 21.1, 0.1, 30.0)
        );
        assert_eq!(s[3].cpu.unwrap().redis, 213.6);
        assert!(s[0].cpu.is_none() && s[2].cpu.is_none(), "no CPU line");
        // Direct's own latency, and the others' added to it.
        let at = |i: usize| s[i].at_rate.clone().unwrap();
        assert_eq!(at(0), [("p50", 0.189), ("p99", 1.488)]);
        let ms = at(2);
        assert!(
            (ms[0].1 - 0.401).abs() < 1e-9 && (ms[1].1 - 1.216).abs() < 1e-9,
            "{ms:?}"
        );
        assert!(s[3].at_rate.is_none());
    }

    #[test]
    fn a_gateway_row_is_compared_with_the_nginx_of_its_section() {
        let names = [
            "direct to upstream",                             // 0
            "nginx proxy",                                    // 1
            "gateway pass-through (no key)",                  // 2
            "gateway miss, redis",                            // 3
            "nginx proxy, https upstream",                    // 4
            "gateway pass-through, https upstream",           // 5
            "axum app + layer, miss",                         // 6
            "gateway miss, fingerprint exact",                // 7
            "nginx proxy, beside postgres",                   // 8
            "gateway miss, postgres (pool_size 64)",          // 9
            "pgbench, the miss's 2 statements (64 clients)",  // 10
            "gateway miss, postgres fsync on (pool_size 64)", // 11
        ];
        let s: Vec<Scenario> = names
            .iter()
            .map(|n| Scenario {
                name: n.to_string(),
                body: 1024,
                rps: 1.0,
                cpu: None,
                at_rate: None,
            })
            .collect();
        let refs: Vec<Option<usize>> = (0..s.len()).map(|i| reference(&s, i)).collect();
        let expected = [
            None,
            None,
            Some(1),
            Some(1),
            None,
            Some(4),
            None,
            None,
            None,
            Some(8),
            None,
            Some(8),
        ];
        assert_eq!(refs, expected);
        // The lines between groups: above the https and postgres sections, the app, and the
        // fingerprint rows; none inside the main table or between PostgreSQL's rows.
        let rows: Vec<&Scenario> = s.iter().collect();
        let groups: Vec<usize> = (1..s.len()).filter(|&i| starts_group(&rows, i)).collect();
        assert_eq!(groups, [4, 6, 7, 8]);
    }
}
