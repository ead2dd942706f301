"""Which engine generates for a version, and where vLLM is installed.

Two engines serve generative versions:

- ``inferd``: the engine in :mod:`inferd.llm` (GPT-2 family; PyTorch only, starts in a
  second, LoRA through inferd's own adapter bank). The dependency-light default.
- ``vllm``: vLLM's engine, in-process in the replica (:mod:`inferd.serving.vllm_core`),
  for any decoder vLLM runs (Llama, Qwen2/2.5/3, Mistral, GPT-2, …).

vLLM is not a dependency of inferd's core install: it pins its own torch, transformers
and web stack. It lives in its own environment (``make vllm`` builds ``.venv-vllm``
with inferd installed in it too), and the local backend starts vLLM replicas with that
environment's interpreter (``llm.vllm_python``). Where vLLM is importable by the server's
own interpreter (``pip install inferd[vllm]`` on a GPU machine), that one is used. Else
``.venv-vllm`` is looked for beside the working directory, the checkout inferd is
installed from and the environment running it, so ``inferd serve`` finds it from any
directory; the error names every place it looked.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ENGINES = ("inferd", "vllm")
OWN_FRAMEWORKS = ("gpt2",)
"""Frameworks inferd's own engine runs."""
LOCAL_VENV = Path(".venv-vllm/bin/python")
INSTALL_HINT = (
    "install it with `make vllm` (a separate environment, .venv-vllm) or `pip install "
    "'inferd[vllm]'`, or point llm.vllm_python at a Python that has it"
)


class EngineUnavailable(ValueError):
    """The engine a version needs is not installed here."""


def engine_of(framework: str, metadata: dict[str, Any], default: str = "auto") -> str:
    """``inferd`` or ``vllm`` for a generative version: its metadata ``engine``, else
    ``default`` (``llm.engine``); ``auto`` is inferd's own engine for what it runs."""
    chosen = metadata.get("engine") or default
    if chosen not in (*ENGINES, "auto"):
        raise ValueError(f"engine must be one of auto, {', '.join(ENGINES)}; not {chosen!r}")
    if chosen == "auto":
        return "inferd" if framework in OWN_FRAMEWORKS else "vllm"
    if chosen == "inferd" and framework not in OWN_FRAMEWORKS:
        raise ValueError(
            f"inferd's own engine runs the GPT-2 family only; this {framework} model needs "
            "engine vllm"
        )
    return str(chosen)


def vllm_python(configured: Path | None = None) -> str | None:
    """The interpreter vLLM replicas run under, or None where vLLM is not installed."""
    if configured is not None:
        return str(configured) if _has_vllm(str(configured)) else None
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    for local in local_venvs():
        if local.is_file() and _has_vllm(str(local)):
            return str(local)
    return None


def local_venvs() -> list[Path]:
    """Where ``make vllm``'s environment may be, in order: beside the working directory,
    in the checkout this inferd is installed from (an editable install: ``make run``'s),
    beside the environment running it. Not resolved: a venv's python is a symlink."""
    roots = (Path.cwd(), Path(__file__).resolve().parents[2], Path(sys.prefix).absolute().parent)
    found: list[Path] = []
    for root in roots:
        if (path := root / LOCAL_VENV) not in found:
            found.append(path)
    return found


def require_vllm(configured: Path | None = None) -> str:
    python = vllm_python(configured)
    if python is None:
        if configured is not None:
            where = f" at {configured}"
        else:
            places = ", ".join(str(p) for p in local_venvs())
            where = f" (looked in {sys.executable} and at {places})"
        raise EngineUnavailable(f"engine vllm is not installed{where}: {INSTALL_HINT}")
    return python


@functools.cache
def _has_vllm(python: str) -> bool:
    if not Path(python).is_file():
        return False
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0


@functools.cache
def vllm_architectures(python: str) -> frozenset[str]:
    """The model architectures (``LlamaForCausalLM``, …) the vLLM under ``python``
    runs; empty when it cannot be asked."""
    probe = (
        "import json; from vllm.model_executor.models import ModelRegistry; "
        "print(json.dumps(sorted(ModelRegistry.get_supported_archs())))"
    )
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=120, text=True)
        return frozenset(json.loads(done.stdout.strip().splitlines()[-1]))
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return frozenset()


def check_supported(folder: Path, framework: str, metadata: dict[str, Any]) -> str:
    """The engine a version would run on (with this process's ``llm`` settings), after
    checking it can: installed, and (vLLM) knowing the folder's architecture. Raises
    :class:`EngineUnavailable` or ValueError with the reason (a push is refused with it)."""
    from inferd.config import LLMConfig, Settings

    try:
        llm = Settings().llm
    except ValueError:  # settings that do not validate fail the server, not this check
        llm = LLMConfig()
    engine = engine_of(framework, metadata, llm.engine)
    if engine == "inferd":
        from inferd.llm.speculation import Speculation

        Speculation.for_version(metadata, llm.speculative)
        return engine
    speculative = metadata.get("speculative")
    if speculative is not None and not isinstance(speculative, dict):
        raise ValueError("metadata.speculative must be an object like vLLM's speculative_config")
    python = require_vllm(llm.vllm_python)
    config = json.loads((Path(folder) / "config.json").read_text())
    architectures = [str(a) for a in config.get("architectures") or ()]
    known = vllm_architectures(python)
    if known and not any(a in known for a in architectures):
        raise ValueError(
            f"vLLM does not run the architecture {', '.join(architectures) or '(none named)'}"
            " of this model"
        )
    return engine
