#!/usr/bin/env bash
# The GPU check (docs/gpu.md): everything the project claims about a GPU, in one call of at most
# 8 minutes. `python -m minivllm.benchmarks.gpu_check` runs the phases, each in a process of its
# own under its own timeout, and rewrites $OUT/gpu_check.json and $OUT/report.md as each one
# ends (a later phase's crash or hang loses nothing).
#
#   tools/gpu_wheels.sh                # once, on a machine with a network: wheels into .whl/
#   tools/gpu_check.sh                 # on the GPU machine: about 8 minutes on one H200
#   tools/gpu_check.sh --quick         # tiny shapes; runs on a CPU (proves the script, no figures)
#   tools/gpu_check.sh --install-only  # the wheel install step and the import check, nothing else
#
# Step 0 installs the wheels in .whl/ (if any) with no index, before anything imports them.
# Extra arguments go to the Python module (e.g. --phases kernels,e2e --budget 300).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-./gpu-results}
WHEELS=${WHEEL_DIR:-.whl}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export OUT

install_only=0
args=()
for a in "$@"; do
    if [ "$a" = "--install-only" ]; then install_only=1; else args+=("$a"); fi
done

# -- step 0: the wheels the GPU machine lacks, from .whl/ only (no index, no config files) ------
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "== installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS (log: $OUT/install.log)"
    reqs=("$WHEELS"/requirements.txt)
    pip_install() {
        PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --disable-pip-version-check --no-index \
            --find-links "$WHEELS" -r "${reqs[0]}" "$@" >>"$OUT/install.log" 2>&1
    }
    : >"$OUT/install.log"
    # a system Python may refuse (externally managed, or not writable): then --user, then
    # --break-system-packages (which only an externally managed system needs)
    pip_install || pip_install --user || pip_install --break-system-packages \
        || echo "wheel install failed (see $OUT/install.log); phases that need them will say so"
else
    echo "== no wheels in $WHEELS (tools/gpu_wheels.sh fetches them); using what is installed"
fi

# Runs from the checkout: minivllm/ is importable from the repository root (minivllm/kernels
# links to the top-level kernels/ folder), so the project itself needs no install.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$install_only" = 1 ]; then
    # the server stack, gguf and nbformat import (torch is not needed for this check)
    "$PY" - <<'EOF'
import importlib
names = ["zmq", "msgspec", "fastapi", "starlette", "pydantic", "pydantic_core", "uvicorn",
         "httpx", "gguf", "nbformat"]
for n in names:
    m = importlib.import_module(n)
    print(f"{n} {getattr(m, '__version__', '')}")
import fastapi, uvicorn, msgspec, zmq
app = fastapi.FastAPI()
@app.get("/ping")
def ping() -> dict:
    return {"ok": True}
uvicorn.Config(app, host="127.0.0.1", port=0)
assert msgspec.msgpack.decode(msgspec.msgpack.encode({"a": [1, 2]})) == {"a": [1, 2]}
zmq.Context().term()
print("server stack, gguf and nbformat import")
EOF
    exit $?
fi

"$PY" -m minivllm.benchmarks.gpu_check --out "$OUT" ${args[@]+"${args[@]}"}
