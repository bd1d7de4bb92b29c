#!/usr/bin/env bash
# The accelerator check, in one command: the whole test suite, then eval.bench at real shapes
# (batch 1 with a profile, the layout x precision comparison, then batch 8 and 32), each within
# a time budget, everything written under OUT_DIR.
#
#   bash tools/gpu_check.sh [OUT_DIR]          # default runs/gpu_check
#   SUITE_S=330 BENCH_S=300 WORKERS=14 bash tools/gpu_check.sh /tmp/out
#   SUITE_S=0 SHAPES=qwen-coder-1.5b bash tools/gpu_check.sh      # the bench alone, one shape
#   ALLOW_CPU=1 SUITE_S=0 BENCH_ARGS="--scale 16 --new_tokens 8" bash tools/gpu_check.sh  # its test
#
# Installs the GPU extra first when jax sees no accelerator (pip install -e ".[gpu,test]"), or
# only the package (no dependencies) where an image already holds jax for the accelerator.
# eval.bench is resumable: a second run with the same OUT_DIR measures only the missing cases.
# Writes suite.log, failures.txt (each failure as it happens: a suite cut short still names
# them), bench.json and bench.md (the table; device, jax and commit in the JSON); then put the
# table into docs/results.md with them.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(mkdir -p "${1:-runs/gpu_check}" && cd "${1:-runs/gpu_check}" && pwd)
export PYTHONUNBUFFERED=1
accel() { python3 -c 'import jax, sys; sys.exit(jax.default_backend() == "cpu")' 2>/dev/null; }
if [ -n "${ALLOW_CPU:-}" ]; then
  echo "== ALLOW_CPU: measuring whatever backend jax has"
elif ! accel; then
  echo "== no accelerator visible to jax: installing the GPU extra"
  python3 -m pip install -q -e ".[gpu,test]" || exit 1
  accel || { echo "jax still sees no accelerator: check the driver (nvidia-smi)"; exit 1; }
elif ! (cd /tmp && python3 -c 'import specjax, eval.bench' 2>/dev/null); then
  echo "== installing specjax itself (the image holds its dependencies)"
  python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
fi
export SPECJAX_COMMIT=${SPECJAX_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
python3 - <<'EOF'
import os, jax, jaxlib
d = jax.devices()[0]
print(f"== {d.device_kind} ({d.platform}) x{jax.device_count()}, jax {jax.__version__}, "
      f"jaxlib {jaxlib.__version__}, commit {os.environ.get('SPECJAX_COMMIT') or 'unknown'}")
EOF

if [ "${SUITE_S:-330}" -gt 0 ]; then
  echo "== the test suite (budget ${SUITE_S:-330} s)"
  : > "$out/failures.txt"
  # The pytest workers share the one GPU: each allocates as it needs rather than 75% up front.
  SPECJAX_FAILURES="$out/failures.txt" XLA_PYTHON_CLIENT_PREALLOCATE=false \
    timeout "${SUITE_S:-330}" python3 -m pytest -q -n "${WORKERS:-14}" -p no:cacheprovider \
    >"$out/suite.log" 2>&1
  echo "== suite exit status $? (124: cut at its budget)"
  tail -n 3 "$out/suite.log"
  grep '^=== ' "$out/failures.txt" | sort -u
fi

shapes=${SHAPES:-qwen-coder-1.5b,qwen-coder-1.5b-90m,qwen2.5-7b,llama-3.1-8b,t5-xl}
first=${shapes%%,*}
start=$(date +%s)
left() { echo $(( ${BENCH_S:-300} - ($(date +%s) - start) )); }
bench() {
  local budget; budget=$(left)
  [ "$budget" -gt 20 ] || { echo "== no bench time left for: $*"; return; }
  echo "== eval.bench $* ($budget s left)"
  # shellcheck disable=SC2086
  timeout "$budget" python3 -m eval.bench --output_json "$out/bench.json" \
    --output_md "$out/bench.md" "$@" ${BENCH_ARGS:-} 2>&1 | grep -v '^| ---' | grep -E '^\||profile|error'
}
bench --shapes "$shapes" --batches 1 --profile
# Where a step's time goes depends on the layout (a scanned stack's layer is sliced out of it)
# and on the matmul precision: the first shape in the four combinations.
bench --shapes "$first" --batches 1 --gammas 5 --layers unrolled --profile
bench --shapes "$first" --batches 1 --gammas 5 --layers unrolled --precision default
bench --shapes "$first" --batches 1 --gammas 5 --layers scan --precision default
bench --shapes "$shapes" --batches 8,32
echo "== done: $out"
