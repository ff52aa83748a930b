#!/usr/bin/env bash
# One short device check of the KV layout on a GPU machine (for the lead; nothing runs it by itself).
#
#   bash bench/gpu_check.sh            # writes $OUT/overhead.json, $OUT/kv_copy.md and $OUT/log (or ./gpu-check/)
#
# What it needs there: Python with slotq's dependencies and llama-cpp-python 0.3.36 built with CUDA
# (CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native" pip install --no-binary llama-cpp-python ...,
# about 5 minutes on 16 cores), or an existing .venv with that build. llama-server joins the comparison when
# SLOTQ_LLAMA_SERVER points at a CUDA build of it (building one there costs another ~5 minutes of device time:
# set BUILD_LLAMA_SERVER=1 and CMAKE_ARGS as above to let bench/llama_server.py do it); otherwise the benchmark
# skips it with the reason.
#
# What it measures (each figure side by side in one run): `slotq bench overhead --json` (the tiny model at 64 and
# 256 streams, slotq split / unified / through Redis, llama-server in both KV modes) and `python -m bench.kv_copy`
# (a cross-stream prefix copy against a re-prefill). No test needs a GPU; this only produces figures for the docs.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check}"
mkdir -p "$out"
py="${PYTHON:-.venv/bin/python}"
[ -x "$py" ] || py=python3
export PYTHONUNBUFFERED=1 SLOTQ_GPU_LAYERS=-1
[ "${BUILD_LLAMA_SERVER:-0}" = 1 ] || [ -n "${SLOTQ_LLAMA_SERVER:-}" ] || export SLOTQ_LLAMA_SERVER=/nonexistent/llama-server
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$py" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'gpu offload:', llama_cpp.llama_supports_gpu_offload())"
  timeout 240 "$py" -m bench.kv_copy --no-write | tee "$out/kv_copy.md"
  timeout 300 "$py" -m jobs.cli bench overhead --json | tee "$out/overhead.json"
} 2>&1 | tee "$out/log"
