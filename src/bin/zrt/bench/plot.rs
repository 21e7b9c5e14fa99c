//! PNG line charts for `zrt bench train --plot DIR`: a value per ZeRO stage
//! (x: stage 0-3), one series per model size and world (and per peer).

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{bail, Context, Result};
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

/// One line: a label and (stage, value) points.
pub struct Series {
    /// The legend text.
    pub label: String,
    /// (stage, value), in stage order.
    pub points: Vec<(f64, f64)>,
    /// Drawn dashed-looking (points only) instead of a solid line.
    pub points_only: bool,
}

/// TTF files tried for the labels (plotters' ab_glyph text needs one).
const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

fn font() -> Result<()> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let path = std::env::var("ZRT_PLOT_FONT")
            .ok()
            .into_iter()
            .chain(FONTS.iter().map(|s| s.to_string()))
            .find(|p| Path::new(p).is_file())
            .ok_or_else(|| {
                "no TTF font for plot labels: install fonts-dejavu-core or set ZRT_PLOT_FONT to a .ttf file".to_string()
            })?;
        let bytes: &'static [u8] = Box::leak(
            std::fs::read(&path)
                .map_err(|e| format!("reading {path}: {e}"))?
                .into_boxed_slice(),
        );
        register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| format!("{path} is not a usable TTF font"))
    })
    .clone()
    .map_err(anyhow::Error::msg)
}

/// Draws `series` against the ZeRO stage into a PNG at `path`.
pub fn by_stage(path: &Path, title: &str, y_label: &str, series: &[Series]) -> Result<()> {
    font()?;
    let top = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    if top <= 0.0 {
        bail!("nothing to plot for {}", path.display());
    }
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(-0.3f64..3.3f64, 0.0..top * 1.6)?;
        chart
            .configure_mesh()
            .x_desc("ZeRO stage")
            .y_desc(y_label)
            .x_labels(4)
            .x_label_formatter(&|x| format!("{:.0}", x))
            .label_style(("sans-serif", 15))
            .draw()?;
        for (k, s) in series.iter().enumerate() {
            let color = Palette99::pick(k).to_rgba();
            let pts: Vec<(f64, f64)> = s
                .points
                .iter()
                .copied()
                .filter(|p| p.1.is_finite())
                .collect();
            let style = color.stroke_width(2);
            if s.points_only {
                chart
                    .draw_series(
                        pts.iter()
                            .map(|&p| TriangleMarker::new(p, 9, color.filled())),
                    )?
                    .label(&s.label)
                    .legend(move |(x, y)| TriangleMarker::new((x + 10, y), 7, color.filled()));
            } else {
                chart
                    .draw_series(LineSeries::new(pts.clone(), style))?
                    .label(&s.label)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
                chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
            }
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .position(SeriesLabelPosition::UpperRight)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw()
        .map_err(|e| anyhow::anyhow!("{e}"))
        .with_context(|| format!("drawing {}", path.display()))
}
