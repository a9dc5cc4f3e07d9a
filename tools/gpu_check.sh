#!/usr/bin/env bash
# The GPU check (docs/gpu.md): the GPU-marked tests, then `python -m minivllm.benchmarks.gpu_check`
# (kernel micro-benchmarks, end-to-end throughput with CUDA graphs on and off vs transformers,
# decode-step times, greedy correctness vs transformers). Results go to $OUT (default
# ./gpu-results): gpu-tests.txt, gpu-tests.xml, gpu_check.json.
#
#   tools/gpu_check.sh            # full run: about 8 minutes on one H200
#   tools/gpu_check.sh --quick    # tiny shapes; runs on a CPU too (proves the script, no figures)
#
# Works offline, from the checkout (no install step).
# Extra arguments go to the Python module (e.g. --phases kernels,e2e --skip-hf).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-./gpu-results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export OUT

# Runs from the checkout: minivllm/ is importable from the repository root (minivllm/kernels
# links to the top-level kernels/ folder), so nothing needs installing beyond the dependencies.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import minivllm.kernels" >"$OUT/install.log" 2>&1; then
    echo "cannot import minivllm here (see $OUT/install.log)"; exit 2
fi

echo "== GPU-marked tests (log: $OUT/gpu-tests.txt)"
# GPU_TEST_PATHS narrows where the GPU tests are looked for (default: all of tests/)
timeout 300 "$PY" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors \
    --junitxml "$OUT/gpu-tests.xml" ${GPU_TEST_PATHS:-tests} >"$OUT/gpu-tests.txt" 2>&1
tests_rc=$?
tail -n 3 "$OUT/gpu-tests.txt"

echo "== benchmarks and checks (JSON: $OUT/gpu_check.json)"
"$PY" -m minivllm.benchmarks.gpu_check --out "$OUT" "$@"
check_rc=$?

echo "tests exit code: $tests_rc, checks exit code: $check_rc"
[ "$tests_rc" -eq 0 ] && [ "$check_rc" -eq 0 ]
