//! Pictures of a simulated schedule: an SVG timeline (ranks as rows, work coloured by
//! micro-batch: forward light, backward dark, weight gradient grey-toned) and a
//! Chrome/Perfetto trace.

use std::fmt::Write as _;

use super::{Schedule, Timeline, Work};

/// The timeline as a self-contained SVG.
pub fn svg(schedule: &Schedule, timeline: &Timeline) -> String {
    let (unit, row, left, top) = (24.0, 28.0, 70.0, 40.0);
    let width = left + timeline.makespan * unit + 20.0;
    let height = top + schedule.stages as f64 * row + 30.0;
    let mut out = String::new();
    let _ = writeln!(out, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" font-family="sans-serif" font-size="11">"#);
    let _ = writeln!(
        out,
        r#"<text x="{left}" y="20" font-size="13">{}: {} stages, {} micro-batches{}: bubble {:.1}%</text>"#,
        schedule.kind.label(),
        schedule.stages,
        schedule.microbatches,
        if schedule.chunks > 1 { format!(", {} chunks per rank", schedule.chunks) } else { String::new() },
        100.0 * timeline.bubble
    );
    for (rank, items) in timeline.ranks.iter().enumerate() {
        let y = top + rank as f64 * row;
        let _ = writeln!(out, r#"<text x="8" y="{:.1}">rank {rank}</text>"#, y + row * 0.6);
        for (item, start, end) in items {
            let hue = 360.0 * item.microbatch as f64 / schedule.microbatches as f64;
            let (saturation, lightness) = match item.work {
                Work::F => (70, 72),
                Work::B => (70, 42),
                Work::W => (25, 58),
            };
            let x = left + start * unit;
            let w = (end - start) * unit;
            let _ = writeln!(
                out,
                r#"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{:.1}" fill="hsl({hue:.0},{saturation}%,{lightness}%)" stroke="white"/>"#,
                row - 4.0
            );
            let label = match item.work {
                Work::F => "F",
                Work::B => "B",
                Work::W => "W",
            };
            let _ = writeln!(out, r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{label}{}</text>"#, x + w / 2.0, y + row * 0.55, item.microbatch);
        }
    }
    out.push_str("</svg>\n");
    out
}

/// The timeline as Chrome/Perfetto trace JSON (one track per rank, times in microseconds
/// with one cost unit = 1 ms).
pub fn trace_json(timeline: &Timeline) -> String {
    let mut events = Vec::new();
    for (rank, items) in timeline.ranks.iter().enumerate() {
        for (item, start, end) in items {
            events.push(serde_json::json!({
                "name": format!("{:?}{}", item.work, item.microbatch),
                "cat": format!("{:?}", item.work),
                "ph": "X",
                "ts": start * 1000.0,
                "dur": (end - start) * 1000.0,
                "pid": 0,
                "tid": rank,
                "args": { "microbatch": item.microbatch, "chunk": item.chunk },
            }));
        }
    }
    serde_json::json!({ "traceEvents": events }).to_string()
}
