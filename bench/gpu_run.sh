#!/usr/bin/env bash
# The GPU checks and figures of inferd's engine, in one run on a machine with an NVIDIA
# GPU and PyTorch (no network needed): the GPU tests, then bench/gpu_llm.py.
#   bash bench/gpu_run.sh OUT_DIR [WHEELS_DIR] [DEMO_MODEL_DIR]
# WHEELS_DIR: wheels of inferd's dependencies that machine lacks (installed into
# /tmp/site); DEMO_MODEL_DIR: the trained demo GPT-2 for the fp8 perplexity figure.
# Env: GPU_TESTS_TIMEOUT (s, default 240), GPU_BENCH_TIMEOUT (s, default 420),
# GPU_BENCH_ARGS (extra arguments for bench/gpu_llm.py).
set -u
out=${1:?out dir}; wheels=${2:-}; demo=${3:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 INFERD_LOG_LEVEL=${INFERD_LOG_LEVEL:-WARNING}
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$wheels"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
timeout "${GPU_TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider \
  -o filterwarnings=ignore -o addopts="" -ra tests/test_llm_cuda.py 2>&1 | tail -40 | tee "$out/tests.log"
demo_args=(); [ -n "$demo" ] && demo_args=(--demo "$demo")
timeout "${GPU_BENCH_TIMEOUT:-420}" python3 bench/gpu_llm.py --out "$out" "${demo_args[@]}" \
  ${GPU_BENCH_ARGS:-} 2>&1 | grep -v -i -E "warn|Loading weights|Writing model" | tee "$out/bench.log" | tail -60
