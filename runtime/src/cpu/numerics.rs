//! Faults: a rank's failing instruction, and `--check-numerics`' search for the first op
//! that makes a NaN or an infinity.

use super::*;

/// Whether executors made from now on check every result for NaN and infinity
/// ([`check_numerics`]).
pub(super) static CHECK_NUMERICS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes every executor created afterwards check each instruction's float results for NaN
/// and infinity and fail at the first instruction that makes one, naming it and its model
/// location (`--check-numerics`). Costs a pass over every result.
pub fn check_numerics(on: bool) {
    CHECK_NUMERICS.store(on, std::sync::atomic::Ordering::SeqCst);
}

/// The first non-finite value of a float slot's first `len` elements: (index, value).
pub(super) fn first_non_finite(storage: &Storage, len: usize) -> Option<(usize, f64)> {
    match storage {
        Storage::F32(v) => v[..len.min(v.len())].iter().position(|x| !x.is_finite()).map(|i| (i, v[i] as f64)),
        Storage::F64(v) => v[..len.min(v.len())].iter().position(|x| !x.is_finite()).map(|i| (i, v[i])),
        Storage::Bf16(v) => v[..len.min(v.len())].iter().position(|x| !x.is_finite()).map(|i| (i, v[i].to_f64())),
        _ => None,
    }
}

/// A fault to inject: rank `rank` fails at instruction `instruction` (of any run range that
/// contains it) in the way `kind` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// Global rank.
    pub rank: usize,
    /// Instruction index.
    pub instruction: usize,
    /// How it fails.
    pub kind: FaultKind,
}

/// How an injected fault fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// The rank's thread panics.
    Panic,
    /// The kernel returns an error.
    Kernel,
    /// The rank stops answering (until the others give up).
    Hang,
}

impl Fault {
    /// Reads `SHARDC_FAULT=RANK:INSTRUCTION:panic|kernel|hang` (tests set it).
    pub fn from_env() -> Option<Fault> {
        let text = std::env::var("SHARDC_FAULT").ok()?;
        let mut parts = text.split(':');
        let rank = parts.next()?.trim().parse().ok()?;
        let instruction = parts.next()?.trim().parse().ok()?;
        let kind = match parts.next()?.trim() {
            "panic" => FaultKind::Panic,
            "kernel" => FaultKind::Kernel,
            "hang" => FaultKind::Hang,
            _ => return None,
        };
        if parts.next().is_some() {
            return None;
        }
        Some(Fault { rank, instruction, kind })
    }
}
