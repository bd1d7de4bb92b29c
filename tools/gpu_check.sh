#!/usr/bin/env bash
# The accelerator check, in one command: eval.bench at real shapes (batch 1 first, then 8 and 32)
# and the whole test suite, each within a time budget, everything written under OUT_DIR.
#
#   bash tools/gpu_check.sh [OUT_DIR]          # default runs/gpu_check
#   BENCH_S=300 SUITE_S=300 SHAPES=qwen-coder-1.5b,qwen2.5-7b bash tools/gpu_check.sh
#
# Installs the GPU extra first when jax sees no accelerator (pip install -e ".[gpu,test]").
# eval.bench is resumable: a second run with the same OUT_DIR measures only the missing cases.
# Writes bench.json, bench.md (the table, headed by device, jax and commit), suite.log and
# suite.xml (JUnit); then paste bench.md into docs/results.md.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu_check}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
accel() { python3 -c 'import jax, sys; sys.exit(jax.default_backend() == "cpu")' 2>/dev/null; }
if ! accel; then
  echo "== no accelerator visible to jax: installing the GPU extra"
  python3 -m pip install -q -e ".[gpu,test]" || exit 1
  accel || { echo "jax still sees no accelerator: check the driver (nvidia-smi)"; exit 1; }
fi
python3 - <<'EOF'
import jax, jaxlib
d = jax.devices()[0]
print(f"== {d.device_kind} ({d.platform}) x{jax.device_count()}, jax {jax.__version__}, "
      f"jaxlib {jaxlib.__version__}")
EOF
export SPECJAX_COMMIT=${SPECJAX_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
echo "== commit ${SPECJAX_COMMIT:-unknown}"

shapes=${SHAPES:-qwen-coder-1.5b,qwen2.5-7b,llama-3.1-8b,t5-xl}
bench() { timeout "$1" python3 -m eval.bench --shapes "$shapes" --batches "$2" \
            --output_json "$out/bench.json" --output_md "$out/bench.md" "${@:3}"; }
start=$(date +%s)
echo "== eval.bench, batch 1 (budget ${BENCH_S:-300} s in all)"
bench "${BENCH_S:-300}" 1 --profile
left=$(( ${BENCH_S:-300} - ($(date +%s) - start) ))
if [ "$left" -gt 30 ]; then
  echo "== eval.bench, batch 8 and 32 ($left s left)"
  bench "$left" 8,32
fi

echo "== the test suite (budget ${SUITE_S:-300} s)"
# Each pytest worker shares the one GPU: allocate as needed rather than 75% each.
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${SUITE_S:-300}" \
  python3 -m pytest -q -n "${WORKERS:-8}" -p no:cacheprovider --junitxml "$out/suite.xml" \
  2>&1 | tee "$out/suite.log" | tail -n 40
echo "== done: $out"
