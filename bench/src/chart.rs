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
}
