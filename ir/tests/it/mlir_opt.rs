//! Every dump shardc prints must parse and verify with upstream `mlir-opt-22`, given only the
//! checked-in dialect file: the IR is real MLIR, not something only shardc can read.

use std::io::Write;
use std::process::{Command, Stdio};

use shardc_ir::mlir::{print_module, IrContext, PrintStyle};
use crate::lower_one;

use crate::{shipped_spec, workspace_root};

/// Runs `mlir-opt-22 --irdl-file=<xf> -` on `text`; returns its output or panics with stderr.
pub fn mlir_opt(text: &str) -> String {
    let irdl = workspace_root().join("ir/dialect/xf.irdl.mlir");
    let mut child = Command::new("mlir-opt-22")
        .arg(format!("--irdl-file={}", irdl.display()))
        .arg("-")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mlir-opt-22 not found: run scripts/setup");
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "mlir-opt-22 rejected the dump:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn every_shipped_spec_parses_with_mlir_opt_in_every_style() {
    let cx = IrContext::new().unwrap();
    for name in ["tiny", "tiny-llama", "gpt2-small", "llama-7b"] {
        let module = lower_one(&shipped_spec(name)).unwrap();
        for style in [PrintStyle::WithLocations, PrintStyle::Plain, PrintStyle::Generic] {
            mlir_opt(&print_module(&cx, &module, style).unwrap());
        }
    }
}

#[test]
fn mlir_opt_round_trip_is_stable() {
    // mlir-opt's output, fed back to mlir-opt, prints identically: nothing shardc prints
    // depends on shardc to be read back.
    let cx = IrContext::new().unwrap();
    let text = print_module(&cx, &lower_one(&shipped_spec("tiny-llama")).unwrap(), PrintStyle::WithLocations).unwrap();
    let once = mlir_opt(&text);
    assert_eq!(once, mlir_opt(&once));
}
