"""Build the demo models locally and register the ones the registry lacks.

``inferd serve --demo`` does it in a child process (``python -m inferd.demo.install``,
:func:`install_demo_isolated`): training and checking them imports PyTorch, XGBoost,
scikit-learn and transformers, ~600 MiB the server would otherwise keep for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inferd.config import Settings
from inferd.demo.cache import Built, DemoCache
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


def _register_built(registry: Registry, name: str, version: str, built: Built) -> str:
    signature = Signature.from_dict(built.signature) if built.signature is not None else None
    return _register(
        registry, name, version, built.folder, built.framework, built.metadata,
        built.description, signature, built.batching,
    )  # fmt: skip


def install_demo(
    registry: Registry,
    work_dir: Path,
    progress: Callable[[str], None],
    llm: bool = True,
    text: bool = True,
    cache: DemoCache | None = None,
) -> list[str]:
    """Returns ``model:version`` of every demo model, newly pushed or already there.
    Without PyTorch (the container image's base variant) the models that need it are
    skipped, saying so. Builds go through ``cache`` (none: every one runs)."""
    from inferd.demo.build import build_demo_model

    cache = cache or DemoCache(None)

    torch = importlib.util.find_spec("torch") is not None
    if not torch:
        progress(
            "demo models needing PyTorch skipped (digits, image-classifier, tinygpt): "
            "pip install 'inferd[llm]'"
        )
    if llm and torch:
        install_llm_demo(registry, work_dir, progress, cache)
    if text:
        install_text_demo(registry, work_dir, progress, cache)
    versions = {n: v for n, v in DEMO_VERSIONS.items() if torch or n not in _NEED_TORCH}
    missing = [name for name, version in versions.items() if not _has(registry, name, version)]
    if not missing:
        progress("demo models already registered: " + ", ".join(versions))
        return [f"{n}:{v}" for n, v in versions.items()]
    progress(f"building demo models locally ({', '.join(missing)}) ...")
    for name in missing:

        def build(name: str = name) -> Built:
            demo = build_demo_model(name, work_dir, progress=progress)
            signature = demo.signature.to_dict() if demo.signature is not None else None
            return Built(demo.path, demo.framework, demo.metadata, demo.description, signature)

        built = cache.build(name, {}, work_dir / name, build, progress)
        framework = _register_built(registry, name, versions[name], built)
        progress(f"registered {name}:{versions[name]} ({framework})")
    return [f"{n}:{v}" for n, v in versions.items()]


DEMO_VERSIONS = {
    "fraud": "v1", "sentiment": "v1", "iris": "v1", "digits": "v1", "image-classifier": "v1",
}  # fmt: skip
_NEED_TORCH = ("digits", "image-classifier")  # trained with PyTorch


LLM_DEMO = ("tinygpt", "v1")


def install_llm_demo(
    registry: Registry, work_dir: Path, progress: Callable[[str], None], cache: DemoCache
) -> None:
    """A small GPT-2 trained here, registered with its LoRA adapter inside its version
    folder (``adapters/reviews``), so one base serves two styles: ``tinygpt`` and
    ``tinygpt-reviews``; with a ChatML chat template, so chat, JSON-schema answers and
    tool calls show on it."""
    name, version = LLM_DEMO
    if _has(registry, name, version):
        return
    folder = work_dir / "llm" / "tinygpt-v1"

    def build() -> Built:
        import shutil

        from inferd.demo.decoders import CHATML_TEMPLATE
        from inferd.demo.llm import build_tiny_gpt2
        from inferd.llm.chat import TEMPLATE_FILE

        progress("building the demo LLM locally (a small GPT-2 and a LoRA adapter, ~2 min) ...")
        demo = build_tiny_gpt2(work_dir / "llm", progress=progress)
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
        return Built(folder, "gpt2", metadata, description, extra={"adapter": adapter_name})

    built = cache.build(name, {}, folder, build, progress)
    _register_built(registry, name, version, built)
    progress(f"registered {name}:{version} (gpt2) with adapter {built.extra['adapter']}")


def install_text_demo(
    registry: Registry, work_dir: Path, progress: Callable[[str], None], cache: DemoCache
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
        if name == EMBEDDING_DEMO[0]:
            metadata = embedding_metadata()
            built = Built(base, "transformers", metadata, description, batching=TEXT_BATCHING)
        else:
            trainer, batching, what = (
                (build_sentiment_classifier, TEXT_BATCHING, "text classifier {} (~10 s)")
                if name == CLASSIFIER_DEMO[0]
                else (build_reranker, RERANKER_BATCHING, "cross-encoder {} (~30 s)")
            )
            folder = work_dir / "text" / name
            train = functools.partial(
                _train_text, trainer, base, folder, what, description, batching, progress
            )
            built = cache.build(name, {}, folder, train, progress)
        _register_built(registry, name, version, built)
        progress(f"registered {name}:{version} (transformers)")
    return [f"{n}:{v}" for (n, v), _ in demos]


def _train_text(
    trainer: Callable[[Path, Path, Callable[[str], None]], dict[str, Any]],
    base: Path,
    folder: Path,
    what: str,
    description: str,
    batching: dict[str, Any],
    progress: Callable[[str], None],
) -> Built:
    progress(f"training the demo {what.format(folder.name)} locally ...")
    metadata = trainer(base, folder, progress)
    return Built(folder, "transformers", metadata, description, batching=batching)


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
        cache = DemoCache(settings.demo_cache_dir)
        install_demo(
            registry, settings.data_dir / "demo-src", _say, settings.demo_llm,
            settings.demo_text, cache,
        )  # fmt: skip


def _say(message: str) -> None:
    print(message, flush=True)


if __name__ == "__main__":
    main()
