#!/usr/bin/env bash
# The GPU checks and figures of inferd's engine, in one run on a machine with an NVIDIA
# GPU and PyTorch (no network needed): the GPU tests, then bench/gpu_llm.py.
#   bash bench/gpu_run.sh OUT_DIR [WHEELS_DIR] [DEMO_MODEL_DIR]
# WHEELS_DIR: wheels of inferd's dependencies that machine lacks (installed into
# /tmp/site; py-spy's too for --profile); DEMO_MODEL_DIR: the trained demo GPT-2 for
# the fp8 perplexity figure. A dependency still missing is named before anything runs.
# Env: GPU_TESTS (0: skip the tests), GPU_TESTS_TIMEOUT (s, default 240),
# GPU_BENCH_TIMEOUT (s, default 420), GPU_BENCH_ARGS (extra arguments for gpu_llm.py).
set -u
out=${1:?out dir}; wheels=${2:-}; demo=${3:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 INFERD_LOG_LEVEL=${INFERD_LOG_LEVEL:-WARNING}
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$wheels"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
else
  export PYTHONPATH=$PWD
fi
python3 -c '
import importlib.util, re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
alias = {"pyyaml": "yaml", "pyjwt": "jwt", "protobuf": "google", "grpcio": "grpc"}
names = [re.split(r"[<>=\[ ]", d)[0].lower() for d in deps]
modules = [alias.get(n, n.replace("-", "_")) for n in names]
missing = [n for n, m in zip(names, modules) if importlib.util.find_spec(m) is None]
if missing:
    print("missing dependencies (add their wheels to WHEELS_DIR):", " ".join(missing))
'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
[ "${GPU_TESTS:-1}" = 0 ] || timeout "${GPU_TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider \
  -o filterwarnings=ignore -o addopts="" -ra tests/test_llm_cuda.py 2>&1 | tail -40 | tee "$out/tests.log"
demo_args=(); [ -n "$demo" ] && demo_args=(--demo "$demo")
timeout "${GPU_BENCH_TIMEOUT:-420}" python3 bench/gpu_llm.py --out "$out" "${demo_args[@]}" \
  ${GPU_BENCH_ARGS:-} 2>&1 | grep -v -i -E "warn|Loading weights|Writing model" | tee "$out/bench.log" | tail -60
