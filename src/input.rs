//! Reading the files a command is given, bounded: a text input (a cluster file, a Hugging Face
//! config, a plan, measured times) is read up to a limit, so a wrong path such as
//! `/dev/zero` or a huge file is an error naming the flag instead of filling memory; binary
//! inputs (weights) must be regular files, whose size is what is read.

use std::io::Read;
use std::path::Path;

use miette::{Result, miette};

/// Most bytes of a small text input: a cluster TOML, a `config.json`, a `measured.json`, the
/// dialect file (each a few kilobytes).
pub const MAX_TEXT_BYTES: u64 = 16 << 20;

/// Most bytes of a plan file (`shardc compile -o`): gpt3-175b's on 256 ranks is 6 MB.
pub const MAX_PLAN_BYTES: u64 = 256 << 20;

/// Reads `path` (given by `what`, e.g. `--cluster`) as UTF-8 text of at most `limit` bytes.
pub fn read_text(what: &str, path: &Path, limit: u64) -> Result<String> {
    let bytes = read_bounded(what, path, limit)?;
    String::from_utf8(bytes).map_err(|e| miette!(help = "give a text file", "{what} {}: not UTF-8 text ({e})", path.display()))
}

/// Reads at most `limit` bytes of `path`; an error names `what` when there are more.
fn read_bounded(what: &str, path: &Path, limit: u64) -> Result<Vec<u8>> {
    let fail = |e: std::io::Error| miette!("{what} {}: {e}", path.display());
    let file = std::fs::File::open(path).map_err(fail)?;
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes).map_err(fail)?;
    if bytes.len() as u64 > limit {
        return Err(miette!(
            help = "check the path: this input is far larger than any file of its kind",
            "{what} {}: more than {}, the most this input may be",
            path.display(),
            shardc_runtime::inspect::bytes(limit)
        ));
    }
    Ok(bytes)
}
