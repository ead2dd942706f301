#!/usr/bin/env bash
# What bench/gpu_run.sh needs on the GPU machine, made here (that machine reaches no
# package index): the wheels of inferd's dependencies its image lacks, at this venv's
# versions, for its Python 3.12 (into .whl/), and the trained demo GPT-2 for the fp8
# perplexity figure (into .gpu/). Both are ignored by git; carry them:
#   bash bench/gpu_prepare.sh
#   device run, carry [".whl", ".gpu"]:  bash bench/gpu_run.sh $OUT .whl .gpu/tiny-gpt2
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >>.git/info/exclude
# Not in that machine's image (its KINDS.md list): inferd's web, storage and protocol
# dependencies and theirs; py-spy for --profile.
names="alembic annotated-types fastapi hpack httptools importlib-metadata jsonschema
  jsonschema-specifications llguidance mako msgspec opentelemetry-api orjson pydantic
  pydantic-core pydantic-settings pyjwt python-dotenv python-multipart redis referencing
  rpds-py sqlalchemy starlette typing-extensions typing-inspection uvicorn py-spy"
mkdir -p .whl
for name in $names; do
  version=$($PY -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
  spec=$name${version:+==$version}
  ls .whl | grep -qi "^$(echo "$name" | tr - _)-${version}" && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_34_x86_64 -d .whl "$spec"
done
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
if [ ! -f .gpu/tiny-gpt2/config.json ]; then
  $PY -c 'from pathlib import Path; from inferd.demo.llm import build_tiny_gpt2
build_tiny_gpt2(Path(".gpu"), print)'
fi
