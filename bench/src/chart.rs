//! Charts of a scenario's samples, as SVG (`plotters`, its SVG backend only: no font
//! files or system libraries; the viewer lays the text out).

use anyhow::{Result, ensure};
use plotters::prelude::*;

use crate::stats;

/// Colours of the series in order: ours first, then the baseline.
const COLOURS: [RGBColor; 3] = [RGBColor(0x1f, 0x77, 0xb4), RGBColor(0x7f, 0x7f, 0x7f), RED];

/// The empirical CDF of each named series of samples (in `unit`) on one chart: the x
/// axis runs to the largest P99.9 of them, so one outlier does not flatten the rest.
pub fn cdf_svg(title: &str, unit: &str, series: &[(&str, &[f64])]) -> Result<String> {
    ensure!(
        !series.is_empty() && series.len() <= COLOURS.len(),
        "a chart of 1 to {} series, not {}",
        COLOURS.len(),
        series.len()
    );
    let sorted: Vec<(&str, Vec<f64>)> = series
        .iter()
        .map(|(name, samples)| {
            let finite: Vec<f64> = samples.iter().copied().filter(|s| s.is_finite()).collect();
            (*name, stats::sorted(&finite))
        })
        .collect();
    for (name, s) in &sorted {
        ensure!(!s.is_empty(), "{name}: no samples to chart");
    }
    let right = sorted
        .iter()
        .map(|(_, s)| stats::percentile(s, 0.999))
        .fold(0.0_f64, f64::max)
        .max(f64::MIN_POSITIVE)
        * 1.05;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (720, 420)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(44)
            .build_cartesian_2d(0.0..right, 0.0..1.0)?;
        chart
            .configure_mesh()
            .x_desc(unit)
            .y_desc("share of samples at or below")
            .draw()?;
        for ((name, s), colour) in sorted.iter().zip(COLOURS) {
            let n = s.len() as f64;
            let points = s
                .iter()
                .enumerate()
                .map(|(i, x)| (x.min(right), (i + 1) as f64 / n));
            chart
                .draw_series(LineSeries::new(points, colour.stroke_width(2)))?
                .label(format!("{name} ({} samples)", s.len()))
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 18, y)], colour.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
    }
    Ok(svg)
}

/// One run's figures per pair.
#[derive(Debug, Clone, Copy)]
pub struct PerPair {
    pub pushes_per_s: f64,
    /// Server CPU time, microseconds per pair.
    pub cpu_us: f64,
    /// Server peak RSS, KiB per pair.
    pub peak_rss_kib: f64,
}

/// One size of a fan-out sweep: the hub's figures and the floor's.
#[derive(Debug, Clone, Copy)]
pub struct SweepPoint {
    pub pairs: f64,
    pub hub: PerPair,
    pub floor: PerPair,
}

/// Three panels side by side, each against the number of pairs (log scale): pushes/s,
/// CPU µs per pair, peak RSS KiB per pair; the hub's line beside the floor's.
pub fn sweep_svg(title: &str, points: &[SweepPoint]) -> Result<String> {
    ensure!(!points.is_empty(), "a sweep chart of no run");
    for p in points {
        let figures = [p.hub, p.floor].map(|f| [f.pushes_per_s, f.cpu_us, f.peak_rss_kib]);
        ensure!(
            p.pairs >= 1.0 && figures.as_flattened().iter().all(|x| x.is_finite()),
            "{} pairs: figures not finite: {p:?}",
            p.pairs
        );
    }
    type Pick = fn(&PerPair) -> f64;
    // The legend where the lines are not: rates rise with size, costs per pair fall.
    let panels: [(&str, Pick, SeriesLabelPosition); 3] = [
        (
            "pushes per second",
            |f| f.pushes_per_s,
            SeriesLabelPosition::UpperLeft,
        ),
        (
            "server CPU, µs per pair",
            |f| f.cpu_us,
            SeriesLabelPosition::UpperRight,
        ),
        (
            "server peak RSS, KiB per pair",
            |f| f.peak_rss_kib,
            SeriesLabelPosition::UpperRight,
        ),
    ];
    let (lo, hi) = points.iter().fold((f64::MAX, 0.0_f64), |(lo, hi), p| {
        (lo.min(p.pairs), hi.max(p.pairs))
    });
    // A decade either side of a single size, so that one run still draws.
    let (lo, hi) = if hi > lo {
        (lo / 1.5, hi * 1.5)
    } else {
        (lo / 10.0, hi * 10.0)
    };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1080, 380)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(title, ("sans-serif", 18))?;
        for (area, (what, pick, legend)) in root.split_evenly((1, 3)).iter().zip(panels) {
            let top = points
                .iter()
                .map(|p| pick(&p.hub).max(pick(&p.floor)))
                .fold(0.0_f64, f64::max)
                .max(f64::MIN_POSITIVE)
                * 1.1;
            let mut chart = ChartBuilder::on(area)
                .caption(what, ("sans-serif", 15))
                .margin(10)
                .x_label_area_size(34)
                .y_label_area_size(56)
                .build_cartesian_2d((lo..hi).log_scale(), 0.0..top)?;
            chart
                .configure_mesh()
                .x_desc("pairs")
                .x_label_formatter(&|x| short(*x))
                .y_label_formatter(&|y| short(*y))
                .draw()?;
            for (name, colour) in [("hub", COLOURS[0]), ("floor", COLOURS[1])] {
                let side = |p: &SweepPoint| if name == "hub" { p.hub } else { p.floor };
                let line = points.iter().map(|p| (p.pairs, pick(&side(p))));
                chart
                    .draw_series(LineSeries::new(line, colour.stroke_width(2)).point_size(3))?
                    .label(name)
                    .legend(move |(x, y)| {
                        PathElement::new([(x, y), (x + 18, y)], colour.stroke_width(2))
                    });
            }
            chart
                .configure_series_labels()
                .position(legend)
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()?;
        }
        root.present()?;
    }
    Ok(svg)
}

/// An axis label: 1500 → "1.5k", 1000000 → "1M", 0.25 → "0.25".
fn short(x: f64) -> String {
    let (scaled, suffix) = match x.abs() {
        a if a >= 1e6 => (x / 1e6, "M"),
        a if a >= 1e3 => (x / 1e3, "k"),
        _ => (x, ""),
    };
    let digits = format!("{scaled:.2}");
    let digits = digits.trim_end_matches('0').trim_end_matches('.');
    format!("{digits}{suffix}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_series_or_an_empty_one_is_an_error_naming_it() {
        assert!(cdf_svg("t", "ms", &[]).is_err());
        let e = cdf_svg("t", "ms", &[("ours", &[1.0]), ("floor", &[])]).unwrap_err();
        assert!(e.to_string().contains("floor: no samples"), "{e}");
        let nan = cdf_svg("t", "ms", &[("ours", &[f64::NAN, f64::INFINITY])]).unwrap_err();
        assert!(nan.to_string().contains("ours: no samples"), "{nan}");
    }

    /// One line per series, a legend naming each with its count, the unit on the axis;
    /// equal samples (a zero-width range) still draw.
    #[test]
    fn each_series_is_one_named_line() {
        let ours: Vec<f64> = (1..=200).map(f64::from).collect();
        let svg = cdf_svg(
            "latency",
            "ms",
            &[("flotilla", &ours), ("floor", &[5.0; 10])],
        )
        .unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        // Each series' line and its legend mark, in its colour (ticks are black).
        for colour in ["#1F77B4", "#7F7F7F"] {
            let drawn = format!("stroke=\"{colour}\" stroke-width=\"2\"");
            assert_eq!(svg.matches(&drawn).count(), 2, "{colour}");
        }
        assert!(!svg.contains("#FF0000"), "no third series");
        assert!(svg.contains("flotilla (200 samples)") && svg.contains("floor (10 samples)"));
        assert!(
            svg.contains(">\nms\n<") || svg.contains(">ms<"),
            "the unit on the x axis"
        );
        assert!(cdf_svg("zero", "ms", &[("all zero", &[0.0; 3])]).is_ok());
    }

    #[test]
    fn axis_labels_are_short() {
        let cases = [
            (1e6, "1M"),
            (1500.0, "1.5k"),
            (100000.0, "100k"),
            (0.25, "0.25"),
            (0.0, "0"),
            (7.0, "7"),
        ];
        for (x, label) in cases {
            assert_eq!(short(x), label, "{x}");
        }
    }

    fn point(pairs: f64, hub: f64) -> SweepPoint {
        let f = |x: f64| PerPair {
            pushes_per_s: x,
            cpu_us: x / 10.0,
            peak_rss_kib: x / 100.0,
        };
        SweepPoint {
            pairs,
            hub: f(hub),
            floor: f(2.0 * hub),
        }
    }

    /// Three panels, each with the hub's and the floor's line (and legend mark), one
    /// marker per size; a single size still draws; no run or a NaN is an error.
    #[test]
    fn a_sweep_draws_hub_and_floor_in_three_panels() {
        let svg = sweep_svg("sweep", &[point(1e4, 50.0), point(1e6, 40.0)]).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        for colour in ["#1F77B4", "#7F7F7F"] {
            let style = format!("stroke=\"{colour}\" stroke-width=\"2\"");
            let lines = format!("<polyline fill=\"none\" opacity=\"1\" {style}");
            let markers = format!("r=\"3\" opacity=\"1\" fill=\"none\" {style}");
            let (lines, markers) = (svg.matches(&lines).count(), svg.matches(&markers).count());
            assert_eq!(lines, 3 * 2, "{colour}: a line and a legend mark per panel");
            assert_eq!(markers, 3 * 2, "{colour}: a marker per size and panel");
        }
        for text in [
            "pushes per second",
            "µs per pair",
            "KiB per pair",
            "\nhub\n",
            "\nfloor\n",
        ] {
            assert!(svg.contains(text), "{text}");
        }
        assert!(sweep_svg("one", &[point(1e5, 3.0)]).is_ok());
        assert!(sweep_svg("none", &[]).is_err());
        let e = sweep_svg("nan", &[point(1e5, f64::NAN)]).unwrap_err();
        assert!(e.to_string().contains("100000 pairs"), "{e}");
    }
}
