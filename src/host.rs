//! This host's memory, and refusing a CPU run that cannot fit in it before it allocates: the
//! run's footprint is read from its compiled programs (`shardc_runtime::memory`) and compared
//! with what the kernel says is available, so the run is refused with both numbers instead of
//! being killed half-way (or thrashing the machine).

use miette::{Result, miette};
use shardc_runtime::Program;

use crate::summary::bytes;

/// Environment variable that sets the bytes to assume this host has available, in place of
/// `MemAvailable` from /proc/meminfo (e.g. `SHARDC_HOST_MEMORY=64GiB`; a large value runs
/// anyway, at the risk of the kernel's out-of-memory killer).
pub const HOST_MEMORY_VAR: &str = "SHARDC_HOST_MEMORY";

/// Bytes of memory available to a run and where the number comes from: the
/// [`HOST_MEMORY_VAR`] override, else `MemAvailable` from /proc/meminfo; `None` when neither
/// is there (not Linux): the check is then skipped.
pub fn available_bytes() -> Result<Option<(u64, String)>> {
    if let Ok(text) = std::env::var(HOST_MEMORY_VAR) {
        let value = parse_bytes(&text).ok_or_else(|| miette!(help = "write a number of bytes, e.g. 68719476736 or 64GiB", "{HOST_MEMORY_VAR}={text}: not a size"))?;
        return Ok(Some((value, format!("as {HOST_MEMORY_VAR} sets"))));
    }
    let Ok(info) = std::fs::read_to_string("/proc/meminfo") else { return Ok(None) };
    let kib = info.lines().find_map(|l| l.strip_prefix("MemAvailable:")).and_then(|rest| rest.split_whitespace().next()).and_then(|n| n.parse::<u64>().ok());
    Ok(kib.map(|kib| (kib.saturating_mul(1024), "MemAvailable in /proc/meminfo".to_string())))
}

/// `12345`, `64GiB`, `512 MiB`, `2TiB` (binary units; `B` optional).
fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = (text[..split].parse::<u64>().ok()?, text[split..].trim());
    let scale: u64 = match unit {
        "" | "B" => 1,
        "KiB" | "K" => 1 << 10,
        "MiB" | "M" => 1 << 20,
        "GiB" | "G" => 1 << 30,
        "TiB" | "T" => 1 << 40,
        _ => return None,
    };
    number.checked_mul(scale)
}

/// Refuses a CPU run of `programs` (all of its ranks run on this host), which reads `data`
/// bytes of training data into memory, whose footprint is more than the host has available,
/// naming both numbers and what makes up the footprint.
pub fn refuse_if_over_memory(programs: &[Program], data: u64) -> Result<()> {
    let Some((available, source)) = available_bytes()? else { return Ok(()) };
    let need = shardc_runtime::memory::cpu_footprint(programs);
    let peak = need.peak().saturating_add(data);
    if peak <= available {
        return Ok(());
    }
    let data_part = if data > 0 { format!(", and {} of training data read into memory (--data)", bytes(data)) } else { String::new() };
    Err(miette!(
        help = format!(
            "train a smaller model, micro-batch or sequence (--micro-batch, --seq) or fewer ranks on this host; price this one for GPUs with `shardc compile --gpu` or `shardc plan`; {HOST_MEMORY_VAR}=BYTES sets the memory to assume"
        ),
        "this CPU run needs about {} of memory at its peak, and this host has {} available ({source}): {} in the storage slots of the memory plans of its {} rank{}, {} of working memory (each rank's largest instruction), {} of pipeline values kept between micro-batches, {} of parameters and optimizer state read back as f64 ({} assembled){data_part}",
        bytes(peak),
        bytes(available),
        bytes(need.slots),
        need.ranks,
        if need.ranks == 1 { "" } else { "s" },
        bytes(need.scratch),
        bytes(need.pipeline),
        bytes(need.state_shards),
        bytes(need.state_global)
    ))
}

