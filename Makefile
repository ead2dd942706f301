# The two commands of the README: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PORT ?= 8000

.PHONY: run test install vllm services lint docs fuzz-h2 bench-tabular bench-latency bench-ray clean

run: install  ## venv + install + build the demo models + serve them on :8000
	$(PY) -m inferd serve --demo --port $(PORT)

test: install vllm services lint docs  ## lint and docs, then the whole test suite (starts the services it needs)
	$(PY) -m pytest -q -n 3 --dist loadfile

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e ".[dev]"
	touch $@

vllm: .venv-vllm/.installed  ## vLLM (CPU build here) in its own environment, for engine: vllm

.venv-vllm/.installed: pyproject.toml scripts/install-vllm.sh
	bash scripts/install-vllm.sh .venv-vllm

services:
	bash scripts/ensure-services.sh

lint: install
	$(VENV)/bin/ruff check inferd tests bench scripts
	$(VENV)/bin/ruff format --check inferd tests bench scripts
	$(VENV)/bin/mypy inferd

docs: install  ## the documentation site (docs/ -> site/), its generated references checked current
	$(PY) scripts/gen_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

fuzz-h2: install  ## the HTTP/2 server fed 20,000 made-up frame sequences (the suite runs 200)
	INFERD_FUZZ_EXAMPLES=20000 $(PY) -m pytest -q -p no:cacheprovider tests/test_h2_fuzz.py

bench-tabular: install
	$(PY) bench/tabular.py

bench-latency: install  ## inferd vs a plain app (vs Ray Serve once `make bench-ray` ran), issue #35
	$(PY) bench/latency.py

bench-ray: .venv-ray/.installed  ## Ray Serve in its own environment, for bench/latency.py's ray target

.venv-ray/.installed:
	$(PYTHON) -m venv .venv-ray
	.venv-ray/bin/pip install --quiet --upgrade pip
	.venv-ray/bin/pip install --quiet "ray[serve]" scikit-learn numpy
	touch $@

clean:
	rm -rf $(VENV) .venv-vllm .venv-ray .inferd
