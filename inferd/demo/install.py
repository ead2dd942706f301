"""Build the demo models locally and register the ones the registry lacks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from inferd.errors import ModelNotFound
from inferd.registry import Registry


def install_demo(registry: Registry, work_dir: Path, progress: Callable[[str], None]) -> list[str]:
    """Returns ``model:version`` of every demo model, newly pushed or already there."""
    from inferd.demo.build import build_demo_models
    from inferd.runtimes import inspect_artifact

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
