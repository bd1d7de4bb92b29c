#!/usr/bin/env bash
# The accelerator check, in one command: eval.bench at real shapes (the 1.5B target with its
# 90M draft at the defaults, profiled; the 7B shape; CUDA-graph command buffers for the loop;
# int8 weights; then the other shapes; then batch 8 and 32), then the whole test suite, each
# within a time budget, everything written under OUT_DIR.
#
#   bash tools/gpu_check.sh [OUT_DIR]          # default runs/gpu_check
#   BENCH_S=290 SUITE_S=250 WORKERS=15 bash tools/gpu_check.sh /tmp/out
#   SUITE_S=420 BENCH_S=0 bash tools/gpu_check.sh /tmp/out   # the suite alone, to its end
#
# The whole suite takes about 420 s on one H200 with 15 workers (360 s reached 95%), the
# bench's cases 100-170 s each: within a 10-minute call, run the suite and the bench as two.
#   SUITE_S=0 SHAPES=qwen-coder-1.5b bash tools/gpu_check.sh      # the bench alone
#   ALLOW_CPU=1 SUITE_S=0 BENCH_ARGS="--scale 16 --new_tokens 8" bash tools/gpu_check.sh  # its test
#
# Installs the GPU extra first when jax sees no accelerator (pip install -e ".[gpu,test]"), or
# only the package (no dependencies) where an image already holds jax for the accelerator, after
# the wheels in .whl/ if there are any (what such an image lacks: gguf, ml-collections).
# eval.bench is resumable: a second run with the same OUT_DIR measures only the missing cases.
# A case compiles and times seven or more programs (minutes at the 7B shape on a fresh machine) and
# one cut by its budget writes nothing: BENCH_S must hold whole cases.
# Writes suite.log, failures.txt (each failure as it happens: a suite cut short still names
# them), bench.json and bench.md (the table; device, jax and commit in the JSON); then put the
# table into docs/results.md with them.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(mkdir -p "${1:-runs/gpu_check}" && cd "${1:-runs/gpu_check}" && pwd)
export PYTHONUNBUFFERED=1
accel() { python3 -c 'import jax, sys; sys.exit(jax.default_backend() == "cpu")' 2>/dev/null; }
if [ -z "${ALLOW_CPU:-}" ] && compgen -G ".whl/*.whl" >/dev/null; then
  # Packages the machine's image lacks, carried as wheels (a machine with no registry access).
  echo "== installing the wheels in .whl/"
  python3 -m pip install -q --no-index --no-deps .whl/*.whl || exit 1
fi
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

shapes=${SHAPES:-qwen-coder-1.5b-90m,qwen2.5-7b,qwen-coder-1.5b,llama-3.1-8b,t5-xl}
first=${shapes%%,*}
rest=${shapes#"$first"}; rest=${rest#,}
start=$(date +%s)
left() { echo $(( ${BENCH_S:-330} - ($(date +%s) - start) )); }
bench() {
  local budget; budget=$(left)
  [ "$budget" -gt 20 ] || { echo "== no bench time left for: $*"; return; }
  echo "== ${XLA_FLAGS:-} eval.bench $* ($budget s left)"
  # shellcheck disable=SC2086
  timeout "$budget" python3 -m eval.bench --output_json "$out/bench.json" \
    --output_md "$out/bench.md" --alpha "${ALPHA:-0.9}" "$@" ${BENCH_ARGS:-} 2>&1 \
    | grep -v '^| ---' | grep -E '^\||profile|rror'
}
# The defaults (bfloat16 weights at precision `default`, layers unrolled off TPU), profiled;
# the 7B shape (the roofline goal); then the loop as CUDA graphs (XLA's command buffers with the
# while loop and conditionals in them: no host round trip per iteration), a separate process as
# XLA_FLAGS are read at start-up, at gamma 7 only.
graphs="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
big=${BIG:-qwen2.5-7b}
bench --shapes "$first" --batches 1 --gammas 5,7 --profile
bench --shapes "$big" --batches 1 --gammas 7
# XLA's optimized HLO of a short run, to read what each profiled kernel fuses (the largest
# modules only: the decoding loops), in a JSON file of its own as its flags differ.
if [ "$(left)" -gt 60 ] && [ -z "${ALLOW_CPU:-}" ]; then
  echo "== the optimized HLO of $first"
  XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$out/hlo --xla_dump_hlo_as_text" timeout "$(left)" \
    python3 -m eval.bench --output_json "$out/hlo.json" --shapes "$first" --batches 1 \
    --gammas 7 --new_tokens 8 --repeats 1 --probe_steps 1 >/dev/null 2>&1
  find "$out/hlo" -type f ! -name '*after_optimizations.txt' -delete 2>/dev/null
  find "$out/hlo" -type f -size -200k -delete 2>/dev/null
  ls "$out/hlo" 2>/dev/null | head -20
fi
XLA_FLAGS="${XLA_FLAGS:-} $graphs" bench --shapes "$first" --batches 1 --gammas 7
# int8 weights (weight-only off the CPU) against the rows above: whether quant="auto" should pick
# int8 on this accelerator.
bench --shapes "$first" --batches 1 --gammas 7 --quant int8
[ -z "$rest" ] || bench --shapes "$rest" --batches 1 --gammas 3,5
bench --shapes "$shapes" --batches 8,32 --gammas 3

if [ "${SUITE_S:-420}" -gt 0 ]; then
  echo "== the test suite (budget ${SUITE_S:-420} s)"
  : > "$out/failures.txt"
  # The pytest workers share the one GPU: each allocates as it needs rather than 75% up front.
  # Autotuning only picks among equivalent kernels: off, the suite compiles faster.
  SPECJAX_FAILURES="$out/failures.txt" XLA_PYTHON_CLIENT_PREALLOCATE=false \
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
    timeout "${SUITE_S:-420}" python3 -m pytest -q -n "${WORKERS:-15}" -p no:cacheprovider \
    >"$out/suite.log" 2>&1
  echo "== suite exit status $? (124: cut at its budget)"
  tail -n 3 "$out/suite.log"
  grep '^=== ' "$out/failures.txt" | sort -u
fi
echo "== done: $out"
