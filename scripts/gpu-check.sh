#!/usr/bin/env bash
# The GPU check, in two halves, for a GPU machine with no Rust toolchain and no network.
#
#   scripts/gpu-check.sh prepare [DIR]   on the build machine (default DIR: out/gpu-check):
#       release-builds the runtime-only binary `shardc-gpu` (CUDA backend, cudarc loading
#       CUDA 13 libraries at run time), compiles the plans it runs with `--target cuda`, and
#       stages binary, plans, corpus, manifest and this script in DIR (checked: < 50 MB).
#   DIR/gpu-check.sh run [DIR]           on the GPU machine (the staged copy of this script):
#       puts the CUDA libraries found under Python's site-packages on LD_LIBRARY_PATH (with
#       the libnccl.so symlink cudarc needs), then
#         1. checks tiny and gpt2-small at tp=1 and at tp=2 (both ranks on the one GPU), in
#            f32 and bf16, against the CPU backend: loss at every step and first-step
#            gradients. Tolerances (relative): f32 loss 1e-4, gradients 1e-3 (summation
#            order differs: cuBLAS, block reductions); bf16 loss 3e-2 (8-bit mantissa,
#            against the f32 CPU run), gradients not compared (a bf16 parameter cannot
#            resolve one small SGD step);
#         2. times a gpt2-small training step and a wide GEMM-bound layer, and prints the
#            achieved GEMM TFLOP/s against cuBLAS's measured peak and the h200 preset's
#            prediction;
#         3. times every distinct kernel of gpt2-small's bf16 step (s=1024, 1 and 4 sequences),
#            a streaming add and a chain of tiny kernels (`shardc-gpu calibrate`): what
#            `shardc calibrate --measured` fits the cluster model on.
#       Exits non-zero on any mismatch. Budget: well under 8 minutes on one H200.
#   scripts/gpu-check.sh report [DIR]    back on the build machine, with DIR as the GPU run
#       left it: fits the h200 cluster model to the measured kernels (DIR/h200-calibrated.toml)
#       and prints each timed step beside the preset's and the calibrated model's prediction.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mode="${1:-}"
dir="${2:-}"

prepare() {
  cd "$here/.."
  dir="${dir:-out/gpu-check}"
  scripts/setup
  echo "gpu-check: building shardc (compiler) and shardc-gpu (runtime only, release)"
  cargo build --locked --bin shardc
  cargo build --locked --release -p shardc-runtime --features cuda --bin shardc-gpu
  rm -rf "$dir" && mkdir -p "$dir/plans"
  cp target/release/shardc-gpu "$dir/"
  strip "$dir/shardc-gpu" 2>/dev/null || true
  cp data/kjv-genesis-exodus.txt "$dir/corpus.txt"
  cp scripts/gpu-check.sh "$dir/"
  local shardc=./target/debug/shardc
  # Checked cases train with SGD so that first-step gradients can be read off the update.
  # One micro-batch per step: the CUDA backend runs no gradient accumulation yet.
  local check=(--target cuda --optimizer sgd --lr 0.1 --microbatches 1)
  plan() { local out="$1"; shift; "$shardc" compile "$@" -o "$dir/plans/$out.json" >/dev/null; echo "  plans/$out.json"; }
  plan tiny-f32-tp1 models/tiny.toml "${check[@]}" --dtype f32
  plan tiny-f32-tp2 models/tiny.toml "${check[@]}" --dtype f32 --mesh tp=2
  plan tiny-bf16-tp1 models/tiny.toml "${check[@]}" --dtype bf16
  plan tiny-bf16-tp2 models/tiny.toml "${check[@]}" --dtype bf16 --mesh tp=2
  local gpt=(models/gpt2-small.toml --seq 128 --micro-batch 2)
  plan gpt2-f32-tp1 "${gpt[@]}" "${check[@]}" --dtype f32
  plan gpt2-f32-tp2 "${gpt[@]}" "${check[@]}" --dtype f32 --mesh tp=2
  plan gpt2-bf16-tp1 "${gpt[@]}" "${check[@]}" --dtype bf16
  # Timed workloads: AdamW, as in training.
  # Priced for the H200 the check runs on: `bench` prints the cluster model's prediction
  # (the h200 preset) beside the measured step.
  bench_plans plan --gpu h200
  # The kernels `shardc-gpu calibrate` times on the GPU, for `report` to fit on.
  "$shardc" calibrate "${calibration[@]}" --emit "$dir/calibration"
  cat > "$dir/manifest.json" <<'JSON'
{
  "data": "corpus.txt",
  "cases": [
    {"name": "tiny f32 tp=1", "program": "plans/tiny-f32-tp1.json", "reference": "plans/tiny-f32-tp1.json", "steps": 5, "lr": 0.1, "loss_tolerance": 1e-4, "gradient_tolerance": 1e-3},
    {"name": "tiny f32 tp=2 (1 GPU)", "program": "plans/tiny-f32-tp2.json", "reference": "plans/tiny-f32-tp2.json", "steps": 5, "lr": 0.1, "loss_tolerance": 1e-4, "gradient_tolerance": 1e-3},
    {"name": "tiny bf16 tp=1", "program": "plans/tiny-bf16-tp1.json", "reference": "plans/tiny-f32-tp1.json", "steps": 5, "lr": 0.1, "loss_tolerance": 3e-2},
    {"name": "tiny bf16 tp=2 (1 GPU)", "program": "plans/tiny-bf16-tp2.json", "reference": "plans/tiny-f32-tp2.json", "steps": 5, "lr": 0.1, "loss_tolerance": 3e-2},
    {"name": "gpt2-small f32 tp=1", "program": "plans/gpt2-f32-tp1.json", "reference": "plans/gpt2-f32-tp1.json", "steps": 3, "lr": 0.1, "loss_tolerance": 1e-4, "gradient_tolerance": 1e-3},
    {"name": "gpt2-small f32 tp=2 (1 GPU)", "program": "plans/gpt2-f32-tp2.json", "reference": "plans/gpt2-f32-tp2.json", "steps": 3, "lr": 0.1, "loss_tolerance": 1e-4, "gradient_tolerance": 1e-3},
    {"name": "gpt2-small bf16 tp=1", "program": "plans/gpt2-bf16-tp1.json", "reference": "plans/gpt2-f32-tp1.json", "steps": 3, "lr": 0.1, "loss_tolerance": 3e-2}
  ],
  "bench": [
    {"name": "gpt2-small step (s=1024, b=8)", "program": "plans/bench-gpt2-bf16.json", "steps": 6},
    {"name": "gpt2-small step (s=1024, b=8)", "program": "plans/bench-gpt2-f32.json", "steps": 4},
    {"name": "wide layer h=4096 (s=512, b=8)", "program": "plans/bench-wide-bf16.json", "steps": 6}
  ]
}
JSON
  local size
  size=$(du -sm "$dir" | cut -f1)
  echo "gpu-check: staged $dir ($size MB)"
  if [ "$size" -ge 50 ]; then
    echo "gpu-check: the staged folder is $size MB, over the 50 MB budget" >&2
    exit 1
  fi
  echo "gpu-check: on the GPU machine run: $dir/gpu-check.sh run $dir"
}

# The timed plans, compiled by `$1` (plan, or a pricing function) with extra arguments.
bench_plans() {
  local how="$1"; shift
  "$how" bench-gpt2-bf16 models/gpt2-small.toml --seq 1024 --micro-batch 8 --microbatches 1 --target cuda --dtype bf16 "$@"
  "$how" bench-gpt2-f32 models/gpt2-small.toml --seq 1024 --micro-batch 8 --microbatches 1 --target cuda --dtype f32 "$@"
  "$how" bench-wide-bf16 models/wide-layer.toml --microbatches 1 --target cuda "$@"
}
# The calibration workload: gpt2-small's bf16 step at the benchmark's sequence length.
calibration=(models/gpt2-small.toml --backend cuda --gpu h200 --seq 1024 --dtype bf16)

report() {
  cd "$here/.."
  dir="${dir:-out/gpu-check}"
  [ -f "$dir/calibration/measured.json" ] || { echo "gpu-check: no $dir/calibration/measured.json: run gpu-check.sh run on the GPU machine first" >&2; exit 1; }
  cargo build --locked --bin shardc
  local shardc=./target/debug/shardc
  "$shardc" calibrate "${calibration[@]}" --measured "$dir/calibration/measured.json" -o "$dir/h200-calibrated.toml"
  printf "\n%-20s %12s %16s %18s\n" "workload" "measured ms" "h200 preset ms" "calibrated ms"
  price() { # name, then compile arguments
    local name="$1"; shift
    local measured preset calibrated
    measured=$(python3 -c "import json,sys; print(1e3 * json.load(open(sys.argv[1]))['plans/$name.json'])" "$dir/bench-measured.json")
    preset=$("$shardc" compile "$@" --gpu h200 2>&1 | awk '/^  estimate/ {print $2}')
    calibrated=$("$shardc" compile "$@" --cluster "$dir/h200-calibrated.toml" 2>&1 | awk '/^  estimate/ {print $2}')
    printf "%-20s %12.2f %16s %18s\n" "$name" "$measured" "$preset" "$calibrated"
  }
  bench_plans price
}

run() {
  dir="${dir:-$here}"
  cd "$dir"
  # CUDA 13 libraries from pip wheels (nvidia-cublas, nvidia-cuda-nvrtc, nvidia-nccl-cu13,
  # or PyTorch's dependencies), wherever site-packages are.
  local sites libs=() links
  sites=$(python3 -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))' 2>/dev/null || true)
  while IFS= read -r site; do
    [ -d "$site/nvidia" ] || continue
    while IFS= read -r libdir; do libs+=("$libdir"); done < <(find "$site/nvidia" -maxdepth 3 -type d -name lib 2>/dev/null)
  done <<< "$sites"
  links=$(mktemp -d)
  # cudarc looks for libnccl.so (and .so.13), not NCCL's libnccl.so.2.
  for libdir in "${libs[@]}"; do
    if [ -e "$libdir/libnccl.so.2" ] && [ ! -e "$links/libnccl.so" ]; then ln -s "$libdir/libnccl.so.2" "$links/libnccl.so"; fi
  done
  local path="$links"
  for libdir in "${libs[@]}"; do path="$path:$libdir"; done
  export LD_LIBRARY_PATH="$path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "gpu-check: CUDA libraries from ${#libs[@]} folders under site-packages"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
  ./shardc-gpu available
  local status=0
  echo "== numerics: GPU against the CPU backend =="
  ./shardc-gpu check manifest.json || status=1
  echo "== speed =="
  ./shardc-gpu bench manifest.json || status=1
  echo "== calibration: the step's kernels, one at a time (fit with gpu-check.sh report) =="
  ./shardc-gpu calibrate calibration || status=1
  exit $status
}

case "$mode" in
  prepare) prepare ;;
  run) run ;;
  report) report ;;
  *) echo "usage: scripts/gpu-check.sh prepare [DIR] | DIR/gpu-check.sh run [DIR] | scripts/gpu-check.sh report [DIR]" >&2; exit 2 ;;
esac
