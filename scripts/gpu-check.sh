#!/usr/bin/env bash
# The GPU check, in two halves, for a GPU machine with no Rust toolchain and no network.
#
#   scripts/gpu-check.sh prepare [DIR]   on the build machine (default DIR: out/gpu-check):
#       release-builds the runtime-only binary `shardc-gpu` (CUDA backend, cudarc loading
#       CUDA 13 libraries at run time), compiles the plans it runs with `--target cuda`
#       (examples/gpu-check-plans.rs builds the one-op attention programs and prices
#       them), compiles every module of them for sm_90 with NVRTC (`shardc-gpu precompile`,
#       no GPU needed) into kernel-cache.tgz, and stages binary, plans, kernel cache,
#       corpus, manifest and this script in DIR (checked: < 50 MB).
#   DIR/gpu-check.sh run [DIR]           on the GPU machine (the staged copy of this script):
#       puts the CUDA libraries found under Python's site-packages on LD_LIBRARY_PATH (with
#       the libnccl.so symlink cudarc needs), unpacks the kernel cache (SHARDC_KERNEL_CACHE),
#       so nothing is compiled there unless the GPU is not an sm_90 one, then
#         1. checks tiny at (dp,tp,pp) = (1,1,1), (2,2,1) and (1,1,2) (1F1B over 4
#            micro-batches), every rank on the one GPU, in f32 and in bf16 mixed precision,
#            tiny with gradient accumulation (4 micro-batches at (1,1,1)), tiny at 1024 rows
#            (the norms' warp-per-row kernels), and gpt2-small at
#            tp=1 and tp=2 and at cp=2 (a ring, and gathered in bf16), against the CPU
#            backend: loss at every step and first-step gradients. Tolerances (relative):
#            f32 loss 1e-4, gradients 1e-3 (summation order differs: cuBLAS, block
#            reductions); bf16 loss 3e-2 (8-bit mantissa, against the f32 CPU run; 2e-3 at
#            cp=2, against the CPU's run of the same bf16 plan), gradients not compared (a
#            bf16 parameter cannot resolve one small SGD step); and attention's outputs and gradients at three
#            bf16 shapes (the tensor-core kernels, which only a GPU runs: the emulation
#            takes their fallback) against the CPU backend, relative 2e-2; a case that
#            cannot run is an ERROR row and the others still run;
#         2. times a gpt2-small training step (s=1024, micro-batch 8, bf16 and f32; bf16 again
#            with cuBLASLt's fused GEMM epilogues replaced by the GEMM and a kernel), a wide
#            GEMM-bound layer, and attention forward+backward at s=4096 and 16384 (and at
#            16384 over cp=2: both ranks' parts against gathered keys), each
#            beside the cluster model's prediction (h200 preset), with MFU, achieved GEMM
#            TFLOP/s against cuBLAS's measured peak, and attention TFLOP/s;
#         3. times every distinct kernel of gpt2-small's bf16 step (s=1024, 1 and 4 sequences),
#            a streaming add and a chain of tiny kernels (`shardc-gpu calibrate`): what
#            `shardc calibrate --measured` fits the cluster model on;
#         4. prints one table of every case: measured, predicted, their ratio, and the
#            verdict, MFU or TFLOP/s (`shardc-gpu table`).
#         2b. profiles each timed step (`shardc-gpu profile`): every instruction timed on the
#            device with events, summed by op and by op and shapes (profile-N.json);
#       Each of 1-3 runs under a time limit (GPU_CHECK_LIMITS, default "200 140 50 90" s) and
#       writes its rows as it goes, so a hang costs one phase and the table shows what did
#       not finish. Exits non-zero on any mismatch. Budget: under 8 minutes on one H200; on
#       2026-12-04 a fresh H200 took 154 s (check 40, bench 70, profile 16, calibration 26)
#       with the kernel cache, where compiling there (NVRTC and the driver's JIT, seconds per
#       large module, one per calibration kernel) did not finish in 8 minutes; the run prints
#       its wall time.
#   scripts/gpu-check.sh report [DIR]    back on the build machine, with DIR as the GPU run
#       left it: fits the h200 cluster model to the measured kernels (DIR/h200-calibrated.toml)
#       and prints each timed step and attention case beside the preset's and the calibrated
#       model's prediction.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mode="${1:-}"
dir="${2:-}"

prepare() {
  cd "$here/.."
  dir="${dir:-out/gpu-check}"
  scripts/setup
  echo "gpu-check: building shardc (compiler), its plan helper and shardc-gpu (runtime only, release)"
  # With the CUDA backend, as scripts/test builds shardc: one debug binary, not two that
  # replace each other under a test run in the same checkout.
  cargo build --locked --features cuda --bin shardc --example gpu-check-plans
  cargo build --locked --release -p shardc-runtime --features cuda --bin shardc-gpu
  rm -rf "$dir" && mkdir -p "$dir/plans"
  cp target/release/shardc-gpu "$dir/"
  strip "$dir/shardc-gpu" 2>/dev/null || true
  cp data/kjv-genesis-exodus.txt "$dir/corpus.txt"
  cp scripts/gpu-check.sh "$dir/"
  local shardc=./target/debug/shardc
  # Checked cases train with SGD so that first-step gradients can be read off the update.
  local check=(--target cuda --optimizer sgd --lr 0.1)
  plan() { local out="$1"; shift; "$shardc" compile "$@" -o "$dir/plans/$out.json" >/dev/null; echo "  plans/$out.json"; }
  # tiny (2 layers, hidden 16, micro-batch 2, global batch 8, 0.8 MFLOP a micro-batch): a
  # few seconds per case on the GPU (module compile, 5 steps, the gradient step) and less on
  # the CPU oracle. (1,1,1) and dp=2,tp=2 take one micro-batch per step (one train_step
  # program, the four ranks of dp x tp on the one GPU); pp=2 runs 1F1B over the spec's 4
  # micro-batches (a program per pipeline rank, both on the GPU); "accum" is the
  # single-device step of 4 micro-batches (gradient accumulation, one pipeline rank).
  for dtype in f32 bf16; do
    plan "tiny-$dtype-111" models/tiny.toml "${check[@]}" --dtype "$dtype" --microbatches 1
    plan "tiny-$dtype-dp2tp2" models/tiny.toml "${check[@]}" --dtype "$dtype" --mesh dp=2,tp=2 --microbatches 1
    plan "tiny-$dtype-pp2" models/tiny.toml "${check[@]}" --dtype "$dtype" --mesh pp=2 --schedule 1f1b
  done
  plan tiny-f32-accum models/tiny.toml "${check[@]}" --dtype f32
  # tiny at micro-batch 128 (1024 rows of 8 tokens): the norms take a warp per row there, as
  # gpt2-small's timed step does, where the cases above take a block per row.
  for dtype in f32 bf16; do
    plan "tiny-$dtype-rows1024" models/tiny.toml "${check[@]}" --dtype "$dtype" --micro-batch 128 --microbatches 1
  done
  # gpt2-small at s=128, micro-batch 2 (256 tokens, 0.2 TFLOP a step): the CPU oracle takes
  # about a second a step on 16 cores, 3 steps and the gradient step per case.
  local gpt=(models/gpt2-small.toml --seq 128 --micro-batch 2 --microbatches 1)
  plan gpt2-f32-tp1 "${gpt[@]}" "${check[@]}" --dtype f32
  plan gpt2-f32-tp2 "${gpt[@]}" "${check[@]}" --dtype f32 --mesh tp=2
  plan gpt2-bf16-tp1 "${gpt[@]}" "${check[@]}" --dtype bf16
  # gpt2-small over cp=2 (each rank half of every sequence, in zigzag order of 4 chunks of
  # 32): as a ring (what auto takes in a step of one micro-batch) and gathered; in bf16 the
  # attention runs the tensor-core kernels' context-parallel forms, checked against the CPU
  # running the same bf16 plan (so the bound can be tight: only the device's rounding differs).
  plan gpt2-f32-cp2 "${gpt[@]}" "${check[@]}" --dtype f32 --mesh cp=2
  plan gpt2-bf16-cp2 "${gpt[@]}" "${check[@]}" --dtype bf16 --mesh cp=2
  plan gpt2-bf16-cp2-gathered "${gpt[@]}" "${check[@]}" --dtype bf16 --mesh cp=2 --cp-attention all-gather
  # Timed workloads: AdamW, as in training.
  # Priced for the H200 the check runs on: the plans carry the cluster model's prediction
  # (the h200 preset) for `bench` to print beside the measured step.
  bench_plans plan --gpu h200
  # Attention forward and backward, one op each, priced by the h200 preset.
  local entries=()
  for shape in "${attention_shapes[@]}"; do
    # shellcheck disable=SC2086
    entries+=("$("$helper" attention $shape "${attention_dims[@]}" --gpu h200 --emit "$dir/plans")")
  done
  # Attention whose outputs and gradients `check` compares with the CPU backend: bf16 on the
  # tensor-core kernels (head dims 128 and 64, grouped-query, causal and not), and an odd
  # shape; small enough for the CPU oracle (a few GFLOP each).
  local checks=()
  for shape in "${attention_check_shapes[@]}"; do
    # shellcheck disable=SC2086
    checks+=("$("$helper" attention $shape --dtype bf16 --gpu h200 --emit "$dir/plans")")
  done
  # Norms whose row cache meets the 48 KiB a block has without opting in, with the block
  # sum's static scratch beside it (the emulated device cannot check the opt-in): GPT-3's
  # 12288 features in fp32 (48 KiB forward, 96 KiB backward), and 6144 backward.
  for shape in "${norm_check_shapes[@]}"; do
    # shellcheck disable=SC2086
    checks+=("$("$helper" norm $shape --gpu h200 --emit "$dir/plans")")
  done
  local attention_checks
  attention_checks=$(IFS=,; echo "${checks[*]}")
  # The kernels `shardc-gpu calibrate` times on the GPU, for `report` to fit on.
  "$shardc" calibrate "${calibration[@]}" --emit "$dir/calibration"
  # Every module compiled ahead for the H200 (sm_90) by NVRTC, which needs no GPU, so the GPU
  # machine loads machine code instead of compiling (seconds per large bf16 module, and an
  # NVRTC compile per calibration kernel). Staged as one archive (cubins compress about 7x);
  # a module the cache lacks (another GPU, a changed plan) is compiled there as before.
  echo "gpu-check: compiling every module for sm_90 (the kernel cache)"
  local cache
  cache=$(mktemp -d)
  LD_LIBRARY_PATH="$(scripts/setup-nvrtc)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$dir/shardc-gpu" precompile sm_90 "$cache/kernel-cache" "$dir/plans" "$dir/calibration" | tail -n 1
  tar czf "$dir/kernel-cache.tgz" -C "$cache" kernel-cache
  rm -rf "$cache"
  local attention
  attention=$(IFS=,; echo "${entries[*]}")
  cat > "$dir/manifest.json" <<JSON
{
  "data": "corpus.txt",
  "cases": [
    {"name": "tiny f32", "program": "plans/tiny-f32-111.json", "reference": "plans/tiny-f32-111.json", "steps": 5, "lr": 0.1, "loss_tolerance": 1e-4, "gradient_tolerance": 1e-3},
    {"name": "tiny bf16", "program": "plans/tiny-bf16-111.json", "reference": "plans/tiny-f32-111.json", "steps": 5, "lr": 0.1, "loss_tolerance": 3e-2},
    {"name": "tiny f32", "program": "plans/tiny-f32-dp2tp2.json", "reference": "plans/tiny-f32-dp2tp2.json", "steps": 5, "lr": 0.1, "loss_tolerance": 1e-4, "gradient_tolerance": 1e-3},
    {"name": "tiny bf16", "program": "plans/tiny-bf16-dp2tp2.json", "reference": "plans/tiny-f32-dp2tp2.json", "steps": 5, "lr": 0.1, "loss_tolerance": 3e-2},
    {"name": "tiny f32", "program": "plans/tiny-f32-pp2.json", "reference": "plans/tiny-f32-pp2.json", "steps": 5, "lr": 0.1, "loss_tolerance": 1e-4, "gradient_tolerance": 1e-3},
    {"name": "tiny bf16", "program": "plans/tiny-bf16-pp2.json", "reference": "plans/tiny-f32-pp2.json", "steps": 5, "lr": 0.1, "loss_tolerance": 3e-2},
    {"name": "tiny f32 accumulation", "program": "plans/tiny-f32-accum.json", "reference": "plans/tiny-f32-accum.json", "steps": 5, "lr": 0.1, "loss_tolerance": 1e-4, "gradient_tolerance": 1e-3},
    {"name": "tiny f32 1024 rows", "program": "plans/tiny-f32-rows1024.json", "reference": "plans/tiny-f32-rows1024.json", "steps": 5, "lr": 0.1, "loss_tolerance": 1e-4, "gradient_tolerance": 1e-3},
    {"name": "tiny bf16 1024 rows", "program": "plans/tiny-bf16-rows1024.json", "reference": "plans/tiny-f32-rows1024.json", "steps": 5, "lr": 0.1, "loss_tolerance": 3e-2},
    {"name": "gpt2-small f32", "program": "plans/gpt2-f32-tp1.json", "reference": "plans/gpt2-f32-tp1.json", "steps": 3, "lr": 0.1, "loss_tolerance": 1e-4, "gradient_tolerance": 1e-3},
    {"name": "gpt2-small f32", "program": "plans/gpt2-f32-tp2.json", "reference": "plans/gpt2-f32-tp2.json", "steps": 3, "lr": 0.1, "loss_tolerance": 1e-4, "gradient_tolerance": 1e-3},
    {"name": "gpt2-small bf16", "program": "plans/gpt2-bf16-tp1.json", "reference": "plans/gpt2-f32-tp1.json", "steps": 3, "lr": 0.1, "loss_tolerance": 3e-2},
    {"name": "gpt2-small f32 cp=2 ring", "program": "plans/gpt2-f32-cp2.json", "reference": "plans/gpt2-f32-cp2.json", "steps": 3, "lr": 0.1, "loss_tolerance": 1e-4, "gradient_tolerance": 1e-3},
    {"name": "gpt2-small bf16 cp=2 ring", "program": "plans/gpt2-bf16-cp2.json", "reference": "plans/gpt2-bf16-cp2.json", "steps": 3, "lr": 0.1, "loss_tolerance": 2e-3},
    {"name": "gpt2-small bf16 cp=2 gathered", "program": "plans/gpt2-bf16-cp2-gathered.json", "reference": "plans/gpt2-bf16-cp2-gathered.json", "steps": 3, "lr": 0.1, "loss_tolerance": 2e-3}
  ],
  "bench": [
    {"name": "gpt2-small step (s=1024, b=8)", "program": "plans/bench-gpt2-bf16.json", "steps": 6},
    {"name": "  the same, epilogues unfused", "program": "plans/bench-gpt2-bf16.json", "steps": 6, "without_cublaslt": true},
    {"name": "gpt2-small step (s=1024, b=8)", "program": "plans/bench-gpt2-f32.json", "steps": 4},
    {"name": "wide layer h=4096 (s=512, b=8)", "program": "plans/bench-wide-bf16.json", "steps": 6}
  ],
  "attention": [$attention],
  "attention_checks": [$attention_checks]
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

# The plan helper (examples/gpu-check-plans.rs), built beside shardc.
helper=./target/debug/examples/gpu-check-plans
# The timed plans, compiled by `$1` (plan, or a pricing function) with extra arguments.
# gpt2-small at s=1024, micro-batch 8 (8192 tokens, 7.2 TFLOP a step by the registry; the
# h200 preset predicts 25 ms in bf16): well under a second a step even in f32 and with slow
# attention, 6 steps in bf16 and 4 in f32. The wide layer (hidden 4096, ffn 16384, 4096
# tokens: GEMMs of 4096 x 4096 x 16384) is GEMM-bound, 5.1 TFLOP a step, 6 steps.
bench_plans() {
  local how="$1"; shift
  "$how" bench-gpt2-bf16 models/gpt2-small.toml --seq 1024 --micro-batch 8 --microbatches 1 --target cuda --dtype bf16 "$@"
  "$how" bench-gpt2-f32 models/gpt2-small.toml --seq 1024 --micro-batch 8 --microbatches 1 --target cuda --dtype f32 "$@"
  "$how" bench-wide-bf16 models/wide-layer.toml --microbatches 1 --target cuda "$@"
}
# Attention: 16384 tokens a run at each sequence (batch 4 at 4096, 1 at 16384, as flash
# attention's benchmarks hold tokens fixed), 16 heads of 128 (hidden 2048), causal, bf16.
# Forward and backward do 1.9 TFLOP at s=4096 and 7.8 TFLOP at s=16384 (the registry counts
# the causal half in full; the table also gives the rate by FlashAttention's count, which
# halves causal attention); `shardc-gpu bench` runs each a warm-up and 3 timed times, so
# even at 2 TFLOP/s the two sequences take about 20 s, and q, k, v take 64 MB each. The third
# is s=16384 under context parallelism (cp=2): each rank's part of the queries, in zigzag
# order, against the gathered keys, both ranks on the one GPU: the same work as the whole
# sequence's, on the kernels that place a part in the sequence, so the two rows compare.
attention_shapes=("--seq 4096 --batch 4" "--seq 16384 --batch 1" "--seq 16384 --batch 1 --cp 2")
attention_dims=(--heads 16 --head-dim 128 --dtype bf16)
attention_check_shapes=(
  "--seq 512 --batch 1 --heads 4 --kv-heads 2 --head-dim 128 --tag check-s512-d128-gqa"
  "--seq 512 --batch 1 --heads 2 --head-dim 64 --causal false --tag check-s512-d64-full"
  "--seq 333 --batch 2 --heads 2 --head-dim 32 --tag check-s333-d32"
)
norm_check_shapes=(
  "--rows 64 --features 12288 --dtype f32"
  "--rows 64 --features 6144 --dtype bf16 --rms true"
)
# The calibration workload: gpt2-small's bf16 step at the benchmark's sequence length.
calibration=(models/gpt2-small.toml --backend cuda --gpu h200 --seq 1024 --dtype bf16)

report() {
  cd "$here/.."
  dir="${dir:-out/gpu-check}"
  [ -f "$dir/calibration/measured.json" ] || { echo "gpu-check: no $dir/calibration/measured.json: run gpu-check.sh run on the GPU machine first" >&2; exit 1; }
  cargo build --locked --features cuda --bin shardc --example gpu-check-plans
  local shardc=./target/debug/shardc
  "$shardc" calibrate "${calibration[@]}" --measured "$dir/calibration/measured.json" -o "$dir/h200-calibrated.toml"
  printf "\n%-60s %12s %16s %18s\n" "workload" "measured ms" "h200 preset ms" "calibrated ms"
  measured() { # seconds of the given programs in bench-measured.json, summed, in ms
    python3 -c "import json,sys; m = json.load(open(sys.argv[1])); print('%.3f' % (1e3 * sum(m[k] for k in sys.argv[2:])))" "$dir/bench-measured.json" "$@"
  }
  price() { # name, then compile arguments
    local name="$1"; shift
    local preset calibrated
    preset=$("$shardc" compile "$@" --gpu h200 2>&1 | awk '/^  estimate/ {print $2}')
    calibrated=$("$shardc" compile "$@" --cluster "$dir/h200-calibrated.toml" 2>&1 | awk '/^  estimate/ {print $2}')
    printf "%-60s %12s %16s %18s\n" "$name" "$(measured "plans/$name.json")" "$preset" "$calibrated"
  }
  bench_plans price
  predicted() { # ms of forward + backward in the helper's JSON
    python3 -c "import json,sys; a = json.loads(sys.argv[1]); print('%.3f' % (1e3 * (a['forward']['predicted_seconds'] + a['backward']['predicted_seconds'])))" "$1"
  }
  for shape in "${attention_shapes[@]}"; do
    local preset calibrated stem
    # shellcheck disable=SC2086
    preset=$("$helper" attention $shape "${attention_dims[@]}" --gpu h200)
    # shellcheck disable=SC2086
    calibrated=$("$helper" attention $shape "${attention_dims[@]}" --cluster "$dir/h200-calibrated.toml")
    # The programs' stem, as gpu-check-plans names them: attention-sS, or attention-sS-cpN.
    stem=$(python3 -c "import sys; a = sys.argv[1].split(); print('attention-s' + a[a.index('--seq') + 1] + ('-cp' + a[a.index('--cp') + 1] if '--cp' in a else ''))" "$shape")
    printf "%-60s %12s %16s %18s\n" "$(python3 -c "import json,sys; print(json.loads(sys.argv[1])['name'])" "$preset")" \
      "$(measured "plans/$stem-fwd.json" "plans/$stem-bwd.json")" "$(predicted "$preset")" "$(predicted "$calibrated")"
  done
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
  # The modules `prepare` compiled for sm_90, loaded instead of compiled.
  if [ -f kernel-cache.tgz ]; then
    rm -rf kernel-cache && tar xzf kernel-cache.tgz
    export SHARDC_KERNEL_CACHE="$PWD/kernel-cache"
    echo "gpu-check: kernel cache of $(find kernel-cache -name '*.cubin' | wc -l) modules"
  fi
  local status=0
  rm -f results-check.json results-bench.json bench-measured.json profile-*.json calibration/measured.json
  # Each phase has a time limit (seconds; GPU_CHECK_LIMITS="check bench profile calibrate"), so a
  # kernel that hangs costs its phase, not the lease: the rows written so far stay and
  # `table` marks what did not finish.
  local limits
  read -r -a limits <<< "${GPU_CHECK_LIMITS:-200 140 50 90}"
  phase() { # limit, then the shardc-gpu command
    local limit="$1"; shift
    local began=$SECONDS rc=0
    timeout --kill-after=5 "$limit" ./shardc-gpu "$@" || rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then echo "gpu-check: shardc-gpu $1 stopped at its limit of $limit s"; fi
    echo "gpu-check: shardc-gpu $1 took $((SECONDS - began)) s"
    return "$rc"
  }
  echo "== numerics: GPU against the CPU backend =="
  phase "${limits[0]:-200}" check manifest.json || status=1
  echo "== speed =="
  phase "${limits[1]:-140}" bench manifest.json || status=1
  echo "== profile: each timed step's instructions on the device =="
  phase "${limits[2]:-50}" profile manifest.json || status=1
  echo "== calibration: the step's kernels, one at a time (fit with gpu-check.sh report) =="
  phase "${limits[3]:-90}" calibrate calibration || status=1
  echo "== gpu-check: every case =="
  ./shardc-gpu table manifest.json || status=1
  echo "gpu-check: run took ${SECONDS} s (budget 480 s)"
  exit $status
}

case "$mode" in
  prepare) prepare ;;
  run) run ;;
  report) report ;;
  *) echo "usage: scripts/gpu-check.sh prepare [DIR] | DIR/gpu-check.sh run [DIR] | scripts/gpu-check.sh report [DIR]" >&2; exit 2 ;;
esac
