"""Build the demo models locally and register the ones the registry lacks.

``inferd serve --demo`` does it in a child process (``python -m inferd.demo.install``,
:func:`install_demo_isolated`): training and checking them imports PyTorch, XGBoost,
scikit-learn and transformers, ~600 MiB the server would otherwise keep for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inferd.config import Settings
from inferd.errors import ModelNotFound
from inferd.registry import Registry
from inferd.shapes.tensors import Signature


def _has(registry: Registry, name: str, version: str) -> bool:
    try:
        registry.get_version(name, version)
    except ModelNotFound:
        return False
    return True


def _register(
    registry: Registry,
    name: str,
    version: str,
    folder: Path,
    framework: str,
    metadata: dict[str, Any],
    description: str,
    signature: Signature | None = None,
    batching: dict[str, Any] | None = None,
) -> str:
    """Check a demo model the way ``inferd models push`` does, and register it; its
    framework."""
    from inferd.runtimes import inspect_artifact

    framework, signature = inspect_artifact(folder, framework, metadata, signature)
    registry.push(
        name, folder, version, framework=framework, signature=signature, metadata=metadata,
        description=description, owner="inferd-demo", batching=batching,
    )  # fmt: skip
    return framework


def install_demo(
    registry: Registry,
    work_dir: Path,
    progress: Callable[[str], None],
    llm: bool = True,
    text: bool = True,
) -> list[str]:
    """Returns ``model:version`` of every demo model, newly pushed or already there.
    Without PyTorch (the container image's base variant) the models that need it are
    skipped, saying so."""
    from inferd.demo.build import build_demo_model

    torch = importlib.util.find_spec("torch") is not None
    if not torch:
        progress(
            "demo models needing PyTorch skipped (digits, image-classifier, tinygpt): "
            "pip install 'inferd[llm]'"
        )
    if llm and torch:
        install_llm_demo(registry, work_dir, progress)
    if text:
        install_text_demo(registry, work_dir, progress)
    versions = {n: v for n, v in DEMO_VERSIONS.items() if torch or n not in _NEED_TORCH}
    missing = [name for name, version in versions.items() if not _has(registry, name, version)]
    if not missing:
        progress("demo models already registered: " + ", ".join(versions))
        return [f"{n}:{v}" for n, v in versions.items()]
    progress(f"building demo models locally ({', '.join(missing)}) ...")
    for name in missing:
        demo = build_demo_model(name, work_dir, progress=progress)
        framework = _register(
            registry, demo.name, demo.version, demo.path, demo.framework, demo.metadata,
            demo.description, demo.signature,
        )  # fmt: skip
        progress(f"registered {demo.name}:{demo.version} ({framework})")
    return [f"{n}:{v}" for n, v in versions.items()]


DEMO_VERSIONS = {
    "fraud": "v1", "sentiment": "v1", "iris": "v1", "digits": "v1", "image-classifier": "v1",
}  # fmt: skip
_NEED_TORCH = ("digits", "image-classifier")  # trained with PyTorch


LLM_DEMO = ("tinygpt", "v1")


def install_llm_demo(registry: Registry, work_dir: Path, progress: Callable[[str], None]) -> None:
    """A small GPT-2 trained here, registered with its LoRA adapter inside its version
    folder (``adapters/reviews``), so one base serves two styles: ``tinygpt`` and
    ``tinygpt-reviews``; with a ChatML chat template, so chat, JSON-schema answers and
    tool calls show on it."""
    name, version = LLM_DEMO
    if _has(registry, name, version):
        return
    import shutil

    from inferd.demo.decoders import CHATML_TEMPLATE
    from inferd.demo.llm import build_tiny_gpt2
    from inferd.llm.chat import TEMPLATE_FILE

    progress("building the demo LLM locally (a small GPT-2 and a LoRA adapter, ~2 min) ...")
    demo = build_tiny_gpt2(work_dir / "llm", progress=progress)
    folder = work_dir / "llm" / "tinygpt-v1"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(demo.base, folder)
    shutil.copytree(demo.adapter, folder / "adapters" / "reviews")
    # a chat template, so /v1/chat/completions prompts it as chat models are prompted
    (folder / TEMPLATE_FILE).write_text(CHATML_TEMPLATE)
    adapter_name = f"{name}-{demo.adapter_name}"
    metadata = {**demo.metadata, "adapters": {adapter_name: "adapters/reviews"}}
    description = (
        "A small GPT-2 trained here on Python docs prose, with a LoRA "
        f"adapter '{adapter_name}' fine-tuned on product reviews."
    )
    _register(registry, name, version, folder, "gpt2", metadata, description)
    progress(f"registered {name}:{version} (gpt2) with adapter {adapter_name}")


def install_text_demo(
    registry: Registry, work_dir: Path, progress: Callable[[str], None]
) -> list[str]:
    """all-MiniLM-L6-v2 from its PyPI package, and a sentiment classifier and a
    cross-encoder trained over it here (see :mod:`inferd.demo.text`); nothing when the
    package is not installed."""
    from inferd.demo.text import (
        CLASSIFIER_DEMO,
        EMBEDDING_DEMO,
        RERANKER_BATCHING,
        RERANKER_DEMO,
        TEXT_BATCHING,
        build_reranker,
        build_sentiment_classifier,
        embedding_metadata,
        minilm_folder,
    )

    base = minilm_folder()
    if base is None:
        progress("text demo skipped: install it with pip install 'inferd[demo]'")
        return []
    demos = (
        (EMBEDDING_DEMO, "all-MiniLM-L6-v2 sentence embeddings (384 dimensions, normalised)."),
        (CLASSIFIER_DEMO, "Product-review sentiment from all-MiniLM-L6-v2: negative or positive."),
        (RERANKER_DEMO, "A cross-encoder over all-MiniLM-L6-v2 ranking reviews for a query."),
    )
    for (name, version), description in demos:
        if _has(registry, name, version):
            continue
        batching = TEXT_BATCHING
        if name == EMBEDDING_DEMO[0]:
            folder, metadata = base, embedding_metadata()
        elif name == CLASSIFIER_DEMO[0]:
            progress(f"training the demo text classifier {name} locally (~10 s) ...")
            folder = work_dir / "text" / name
            metadata = build_sentiment_classifier(base, folder, progress)
        else:
            progress(f"training the demo cross-encoder {name} locally (~30 s) ...")
            folder = work_dir / "text" / name
            metadata, batching = build_reranker(base, folder, progress), RERANKER_BATCHING
        _register(
            registry, name, version, folder, "transformers", metadata, description,
            batching=batching,
        )  # fmt: skip
        progress(f"registered {name}:{version} (transformers)")
    return [f"{n}:{v}" for (n, v), _ in demos]


async def install_demo_isolated(settings: Settings, progress: Callable[[str], None]) -> None:
    """:func:`install_demo` for the server's registry, in a child process: ``settings``
    go on its stdin (they may hold secrets), its progress lines come back to
    ``progress``; its errors are on stderr, and it failing stops the server."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "inferd.demo.install",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(settings.model_dump_json().encode())
        await proc.stdin.drain()
        proc.stdin.close()
        async for line in proc.stdout:
            progress(line.decode(errors="replace").rstrip("\n"))
        code = await proc.wait()
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    if code != 0:
        raise SystemExit(f"error: building the demo models failed (exit code {code})")


def main() -> None:
    from inferd.process import die_with_parent
    from inferd.telemetry.logging import configure_logging

    settings = Settings.model_validate_json(sys.stdin.buffer.read())
    configure_logging(settings.log_level, settings.log_json, "server")
    die_with_parent()
    with Registry.from_settings(settings) as registry:
        install_demo(
            registry, settings.data_dir / "demo-src", _say, settings.demo_llm, settings.demo_text
        )


def _say(message: str) -> None:
    print(message, flush=True)


if __name__ == "__main__":
    main()
