//! Plan files (`shardc compile -o`) and rank programs, read back and described for
//! `shardc inspect`: the file's header (model, mesh, passes), and per program its buffers,
//! memory plan, ops, pipeline stages and schedule.
//!
//! A plan file is untrusted input (it may have been edited, truncated or be something else
//! entirely): [`read_plan`] checks the format version and validates every program
//! ([`Program::validate`], which also checks the memory plan's totals against the buffers)
//! before anything is described, so describing cannot index out of range, overflow, or print
//! byte counts the buffers do not make. Only the fields `inspect` shows are read from the
//! header, so this crate needs neither the spec nor the summary types.

use crate::program::{Program, Phase};
use crate::RuntimeError;

/// The plan file format version `shardc compile -o` writes.
pub const PLAN_FORMAT_VERSION: u32 = 1;

/// Schedule items a description lists per rank before it says how many more there are.
const MAX_LISTED_ITEMS: usize = 48;

/// What a plan file says about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanHeader {
    /// The model's name.
    pub model: String,
    /// The mesh, as `dp=2,tp=4,pp=1`.
    pub mesh: String,
    /// The passes that ran, in order.
    pub passes: Vec<String>,
}

/// Reads a plan file's text (a JSON object with `programs`) or a single rank program's, and
/// validates every program. Errors name the field (`programs[1]`, `format_version`) or the
/// program's problem.
pub fn read_plan(text: &str) -> Result<(Option<PlanHeader>, Vec<Program>), RuntimeError> {
    let bad = |m: String| RuntimeError::Binding(m);
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let Some(programs) = value.get("programs") else {
        // A single rank program.
        let program = Program::from_json(text)?;
        program.validate()?;
        return Ok((None, vec![program]));
    };
    match value.get("format_version").and_then(serde_json::Value::as_u64) {
        Some(v) if v == PLAN_FORMAT_VERSION as u64 => {}
        other => return Err(bad(format!("plan `format_version` is {}, this shardc reads {PLAN_FORMAT_VERSION}; recompile the plan", other.map_or("missing".into(), |v| v.to_string())))),
    }
    let model = value.pointer("/spec/name").and_then(serde_json::Value::as_str).ok_or_else(|| bad("the plan has no `spec.name`".into()))?;
    // Printed to the terminal: no escape sequences (specs with them are refused at compile).
    if model.chars().any(char::is_control) {
        return Err(bad("the plan's `spec.name` contains control characters".into()));
    }
    // As every command prints it (cp only where there is context parallelism; plans written
    // before cp existed have none).
    let mesh = value
        .get("mesh")
        .cloned()
        .and_then(|m| serde_json::from_value::<shardc_ir::mesh::Mesh>(m).ok())
        .filter(|m| [m.dp, m.tp, m.pp, m.cp].iter().all(|&n| n >= 1))
        .ok_or_else(|| bad("the plan's `mesh` does not give dp, tp and pp".into()))?
        .to_string();
    let passes = match value.get("passes") {
        Some(serde_json::Value::Array(items)) => items
            .iter()
            .map(|p| p.as_str().filter(|p| !p.chars().any(char::is_control)).map(String::from))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("the plan's `passes` are not pass names".into()))?,
        _ => return Err(bad("the plan has no `passes`".into())),
    };
    let programs = programs.as_array().ok_or_else(|| bad("the plan's `programs` is not a list".into()))?;
    if programs.is_empty() {
        return Err(bad("the plan holds no programs".into()));
    }
    let programs = programs
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let program = Program::from_value(p.clone()).map_err(|e| bad(format!("`programs[{i}]`: {e}")))?;
            program.validate().map_err(|e| bad(format!("`programs[{i}]` (@{}): {e}", shown(&program.name))))?;
            Ok(program)
        })
        .collect::<Result<Vec<_>, RuntimeError>>()?;
    Ok((Some(PlanHeader { model: model.to_string(), mesh, passes }), programs))
}

/// `text` with control characters (terminal escapes) shown escaped rather than acted on.
fn shown(text: &str) -> String {
    text.chars().map(|c| if c.is_control() { c.escape_debug().to_string() } else { c.to_string() }).collect()
}

/// A byte count in binary units (`1.5 MiB`).
pub fn bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < units.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{n} B") } else { format!("{value:.1} {}", units[unit]) }
}

/// A validated program, readably: instructions, buffers and slots, the memory plan, ops, and
/// with a pipeline its stages and (the first few of) its schedule items; with `instrs`, every
/// instruction with its buffers.
pub fn describe(program: &Program, instrs: bool) -> String {
    let mut out = String::new();
    let mut line = |text: String| {
        out.push_str(&text);
        out.push('\n');
    };
    let m = &program.memory;
    let name = shown(&program.name);
    line(format!("program @{name}: {} instructions, {} buffers in {} slots", program.instrs.len(), program.buffers.len(), m.slots.len()));
    line(format!("  arguments    {} ({} buffers)", bytes(m.argument_bytes as u64), program.args.len()));
    line(format!(
        "  temporaries  {} peak with reuse, {} without ({:.1}x saved)",
        bytes(m.temporary_bytes as u64),
        bytes(m.temporary_bytes_without_reuse as u64),
        m.temporary_bytes_without_reuse as f64 / m.temporary_bytes.max(1) as f64
    ));
    line(format!(
        "  live bound   {} of temporaries alive at once at most (the plan's peak is {:.2}x it)",
        bytes(m.live_bound_bytes as u64),
        m.temporary_bytes as f64 / m.live_bound_bytes.max(1) as f64
    ));
    line(format!("  peak         {}", bytes(program.peak_bytes() as u64)));
    if !m.buckets.is_empty() {
        let members: usize = m.buckets.iter().map(|r| r.members.len()).sum();
        let total: usize = m.buckets.iter().map(|r| r.bytes).sum();
        line(format!("  dp buckets   {} region{} of the arena ({} gradients, {}), one all-reduce each", m.buckets.len(), if m.buckets.len() == 1 { "" } else { "s" }, members, bytes(total as u64)));
    }
    let mut counts = std::collections::BTreeMap::new();
    for i in &program.instrs {
        *counts.entry(shown(&i.op)).or_insert(0) += 1;
    }
    line(format!("  ops          {}", counts.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ")));
    if let Some(pipeline) = &program.pipeline {
        for chunk in &pipeline.chunks {
            let sizes: Vec<String> = Phase::ALL.iter().map(|&s| format!("{} {}", s.label(), chunk.range(s).len())).collect();
            line(format!(
                "  stage {:<6} instructions: {}; keeps {} buffers per micro-batch, sums {} over micro-batches",
                chunk.stage,
                sizes.join(", "),
                chunk.keep_forward.len() + chunk.keep_backward.len(),
                chunk.sum_backward.len() + chunk.sum_weight.len()
            ));
        }
        // Thousands of micro-batches make thousands of items: the pattern shows in the first.
        let shown = pipeline.items.iter().take(MAX_LISTED_ITEMS).map(|i| format!("{:?}{}{}", i.work, i.microbatch, if pipeline.chunks.len() > 1 { format!(".{}", i.chunk) } else { String::new() }));
        let mut items = shown.collect::<Vec<_>>().join(" ");
        if pipeline.items.len() > MAX_LISTED_ITEMS {
            items.push_str(&format!(" ... and {} more", pipeline.items.len() - MAX_LISTED_ITEMS));
        }
        line(format!("  schedule     {} on pipeline rank {} of {}: {items}", pipeline.kind.label(), pipeline.rank, pipeline.ranks));
    }
    if instrs {
        for (index, instr) in program.instrs.iter().enumerate() {
            let show = |ids: &[usize]| ids.iter().map(|&b| format!("b{b}{:?}", program.buffers[b].shape)).collect::<Vec<_>>().join(" ");
            line(format!("  {index:>5}  {:<22} {:<34} {} -> {}", shown(&instr.op), shown(&instr.loc), show(&instr.inputs), show(&instr.outputs)));
        }
    }
    out
}
