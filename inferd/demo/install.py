"""Build the demo models locally and register the ones the registry lacks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from inferd.errors import ModelNotFound
from inferd.registry import Registry


def install_demo(
    registry: Registry,
    work_dir: Path,
    progress: Callable[[str], None],
    llm: bool = True,
    text: bool = True,
) -> list[str]:
    """Returns ``model:version`` of every demo model, newly pushed or already there."""
    from inferd.demo.build import build_demo_models
    from inferd.runtimes import inspect_artifact

    if llm:
        install_llm_demo(registry, work_dir, progress)
    if text:
        install_text_demo(registry, work_dir, progress)
    missing = []
    for name, version in DEMO_VERSIONS.items():
        try:
            registry.get_version(name, version)
        except ModelNotFound:
            missing.append(name)
    if not missing:
        progress("demo models already registered: " + ", ".join(DEMO_VERSIONS))
        return [f"{n}:{v}" for n, v in DEMO_VERSIONS.items()]
    progress(f"building demo models locally ({', '.join(missing)}) ...")
    for demo in build_demo_models(work_dir, progress=progress):
        if demo.name not in missing:
            continue
        framework, signature = inspect_artifact(
            demo.path, demo.framework, demo.metadata, demo.signature
        )
        registry.push(
            demo.name,
            demo.path,
            demo.version,
            framework=framework,
            signature=signature,
            metadata=demo.metadata,
            description=demo.description,
            owner="inferd-demo",
        )
        progress(f"registered {demo.name}:{demo.version} ({framework})")
    return [f"{n}:{v}" for n, v in DEMO_VERSIONS.items()]


DEMO_VERSIONS = {"fraud": "v1", "sentiment": "v1", "iris": "v1", "digits": "v1"}


LLM_DEMO = ("tinygpt", "v1")


def install_llm_demo(registry: Registry, work_dir: Path, progress: Callable[[str], None]) -> None:
    """A small GPT-2 trained here, registered with its LoRA adapter inside its version
    folder (``adapters/reviews``), so one base serves two styles: ``tinygpt`` and
    ``tinygpt-reviews``."""
    name, version = LLM_DEMO
    try:
        registry.get_version(name, version)
        return
    except ModelNotFound:
        pass
    import shutil

    from inferd.demo.llm import build_tiny_gpt2
    from inferd.runtimes import inspect_artifact

    progress("building the demo LLM locally (a small GPT-2 and a LoRA adapter, ~2 min) ...")
    demo = build_tiny_gpt2(work_dir / "llm", progress=progress)
    folder = work_dir / "llm" / "tinygpt-v1"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(demo.base, folder)
    shutil.copytree(demo.adapter, folder / "adapters" / "reviews")
    adapter_name = f"{name}-{demo.adapter_name}"
    metadata = {**demo.metadata, "adapters": {adapter_name: "adapters/reviews"}}
    framework, signature = inspect_artifact(folder, "gpt2", metadata)
    registry.push(
        name,
        folder,
        version,
        framework=framework,
        signature=signature,
        metadata=metadata,
        owner="inferd-demo",
        description="A small GPT-2 trained here on Python docs prose, with a LoRA "
        f"adapter '{adapter_name}' fine-tuned on product reviews.",
    )
    progress(f"registered {name}:{version} (gpt2) with adapter {adapter_name}")


def install_text_demo(
    registry: Registry, work_dir: Path, progress: Callable[[str], None]
) -> list[str]:
    """all-MiniLM-L6-v2 from its PyPI package, and a sentiment classifier trained over it
    here (see :mod:`inferd.demo.text`); nothing when the package is not installed."""
    from inferd.demo.text import (
        CLASSIFIER_DEMO,
        EMBEDDING_BATCHING,
        EMBEDDING_DEMO,
        build_sentiment_classifier,
        embedding_metadata,
        minilm_folder,
    )
    from inferd.runtimes import inspect_artifact

    base = minilm_folder()
    if base is None:
        progress("text demo skipped: install it with pip install 'inferd[demo]'")
        return []
    for (name, version), description in (
        (EMBEDDING_DEMO, "all-MiniLM-L6-v2 sentence embeddings (384 dimensions, normalised)."),
        (CLASSIFIER_DEMO, "Product-review sentiment from all-MiniLM-L6-v2: negative or positive."),
    ):
        try:
            registry.get_version(name, version)
            continue
        except ModelNotFound:
            pass
        if name == EMBEDDING_DEMO[0]:
            folder, metadata = base, embedding_metadata(base)
        else:
            progress(f"training the demo text classifier {name} locally (~10 s) ...")
            folder = work_dir / "text" / name
            metadata = build_sentiment_classifier(base, folder, progress)
        framework, signature = inspect_artifact(folder, "transformers", metadata)
        registry.push(
            name,
            folder,
            version,
            framework=framework,
            signature=signature,
            metadata=metadata,
            description=description,
            owner="inferd-demo",
            batching=EMBEDDING_BATCHING,
        )
        progress(f"registered {name}:{version} (transformers)")
    return [f"{n}:{v}" for n, v in (EMBEDDING_DEMO, CLASSIFIER_DEMO)]
