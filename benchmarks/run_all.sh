#!/usr/bin/env bash
# Runs the GPU tests and the benchmarks on one GPU, each under its own time limit, and writes
# results (CSV, JSON, PNG, logs) under $1 (default: results/). A short summary is printed last.
#
#   bash benchmarks/run_all.sh results
#
# From the environment: TEST_FILES (test files under tests/ run on the GPU); limits in seconds
# TESTS_S, OVERHEAD_S, KERNELS_S, CURRENT_S (bench_current_scaling.py), CEILING_S (copy_ceiling.py), MLP_S, E2E_S (fuse.convert=all), and, off by default (0 skips a
# step), PATTERNS_S (access_patterns.py: the passes' traffic with no arithmetic, in whole waves and one tile per
# program), E2E_MLP_S (fuse.convert=mlp at E2E_MLP_DIMS, default 2048,4096), SWEEP_S (launch-configuration
# sweep of SWEEP_KERNELS, default all four passes, at SWEEP_SIZES, default 16384x6400), ABLATION_S
# (kernel_ablation.py at SWEEP_SIZES), ISSUE_S (mlp_issue_time.py: is the MLP step host-bound) and
# TMA_S (tma_variants.py: the passes with TMA descriptor loads and stores), ORDER_S (row_order.py: row tiles
# in one range per row group or dealt in turn), FORMS_S (fused_forms.py: the fused pass's forms beside the
# same-run torch.compile baseline; FORMS, default 'shipped in_turn stages1') and DTYPES_S (input_dtypes.py: the
# bias gradient's pass with bf16 and fp16 inputs in buffers placed anew).
# A step cut off by its limit keeps what it wrote so far.
set -u
out="$(realpath -m "${1:-results}")"
mkdir -p "$out"
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
step() {  # name, limit, command...
  local name="$1" limit="$2"; shift 2
  [ "$limit" = 0 ] && return
  local start=$SECONDS
  (cd "$here" && timeout "$limit" "$@" > "$out/$name.log" 2>&1)
  echo "$name: exit $? after $((SECONDS - start)) s" >> "$out/summary.txt"
}
: > "$out/summary.txt"
tests="${TEST_FILES:-test_gpu.py test_scale_update.py test_handoff.py}"
step gpu_tests "${TESTS_S:-300}" python -m pytest -q -p no:cacheprovider $(for t in $tests; do echo "$root/tests/$t"; done)
step overhead "${OVERHEAD_S:-60}" python bench_overhead.py --out "$out/overhead"
step kernels "${KERNELS_S:-300}" python bench_kernels.py --out "$out/kernels"
step current_scaling "${CURRENT_S:-240}" python bench_current_scaling.py --out "$out/current_scaling"
step copy_ceiling "${CEILING_S:-120}" python copy_ceiling.py --out "$out/copy_ceiling"
step access_patterns "${PATTERNS_S:-0}" python access_patterns.py --out "$out/access_patterns"
step mlp "${MLP_S:-200}" python bench_mlp.py --out "$out/mlp"
step e2e "${E2E_S:-300}" python bench_e2e.py --steps 30 --parity-steps 200 --out "$out/e2e"
step e2e_mlp "${E2E_MLP_S:-0}" python bench_e2e.py --dims "${E2E_MLP_DIMS:-2048,4096}" --convert mlp --steps 30 --out "$out/e2e_mlp"
step sweep "${SWEEP_S:-0}" python bench_kernels.py --sweep --sweep-only --sweep-sizes "${SWEEP_SIZES:-16384x6400}" \
  --sweep-kernel "${SWEEP_KERNELS:-quantize,dbias_quantize,dact_dbias_quantize,bias_act}" --out "$out/sweep"
step ablation "${ABLATION_S:-0}" python kernel_ablation.py --sizes "${SWEEP_SIZES:-16384x6400}" --out "$out/ablation"
step issue "${ISSUE_S:-0}" python mlp_issue_time.py
step tma "${TMA_S:-0}" python tma_variants.py --out "$out/tma"
step row_order "${ORDER_S:-0}" python row_order.py --out "$out/row_order"
step fused_forms "${FORMS_S:-0}" python fused_forms.py $(for f in ${FORMS:-shipped in_turn stages1}; do echo --form "$f"; done) \
  --out "$out/fused_forms"
step input_dtypes "${DTYPES_S:-0}" python input_dtypes.py --out "$out/input_dtypes"
cat "$out/summary.txt"
tail -n 3 "$out/gpu_tests.log" 2>/dev/null
for name in overhead kernels current_scaling mlp e2e e2e_mlp sweep ablation issue tma row_order fused_forms input_dtypes; do
  [ -f "$out/$name.log" ] && { echo "== $name"; grep -v -i "warn" "$out/$name.log" | tail -n 12; }
done
exit 0
