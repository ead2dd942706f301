"""The demo build cache (:mod:`inferd.demo.cache`): a second build of the same inputs
copies the first's files, any change of input builds again, and a failed build stores
nothing."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

from inferd.config import Settings
from inferd.demo import cache as demo_cache
from inferd.demo.build import build_demo_model
from inferd.demo.cache import Built, DemoCache


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _counting(folder: Path, calls: list[int]):
    def build() -> Built:
        calls.append(1)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "weights.bin").write_bytes(b"w" * 1000)
        (folder / "sub").mkdir(exist_ok=True)
        (folder / "sub" / "config.json").write_text('{"a": 1}')
        return Built(folder, "sklearn", {"accuracy": 0.9}, "a demo", batching={"replicas": 2})

    return build


def test_a_second_build_of_the_same_inputs_copies_the_first(tmp_path: Path) -> None:
    cache, calls, said = DemoCache(tmp_path / "cache"), [], []
    first = cache.build(
        "m", {}, tmp_path / "a" / "m", _counting(tmp_path / "a" / "m", calls), said.append
    )
    second = cache.build(
        "m", {}, tmp_path / "b" / "m", _counting(tmp_path / "b" / "m", calls), said.append
    )
    assert calls == [1]
    assert second.folder == tmp_path / "b" / "m"
    assert _digest(second.folder) == _digest(first.folder) != {}
    assert (second.metadata, second.batching, second.framework) == (
        {"accuracy": 0.9}, {"replicas": 2}, "sklearn",
    )  # fmt: skip
    assert said and "from the cache" in said[-1]


def test_other_parameters_or_sources_build_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, calls = DemoCache(tmp_path / "cache"), []
    cache.build("m", {}, tmp_path / "a", _counting(tmp_path / "a", calls), print)
    cache.build("m", {"epochs": 2}, tmp_path / "b", _counting(tmp_path / "b", calls), print)
    cache.build("n", {}, tmp_path / "c", _counting(tmp_path / "c", calls), print)
    assert len(calls) == 3
    # the demo's code or data changed: every key changes
    sources = tmp_path / "demo"
    sources.mkdir()
    (sources / "build.py").write_text("SEED = 1\n")
    monkeypatch.setattr(demo_cache, "DEMO_SOURCES", sources)
    fresh = DemoCache(tmp_path / "cache")
    fresh.build("m", {}, tmp_path / "d", _counting(tmp_path / "d", calls), print)
    assert len(calls) == 4
    (sources / "build.py").write_text("SEED = 2\n")
    assert DemoCache(None).key("m", {}) != fresh.key("m", {})


def test_a_failed_build_stores_nothing(tmp_path: Path) -> None:
    cache, calls = DemoCache(tmp_path / "cache"), []

    def broken() -> Built:
        (tmp_path / "x").mkdir()
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        cache.build("m", {}, tmp_path / "x", broken, print)
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []
    cache.build("m", {}, tmp_path / "y", _counting(tmp_path / "y", calls), print)
    assert calls == [1]


def test_two_builds_at_once_build_once(tmp_path: Path) -> None:
    calls: list[int] = []
    started = threading.Barrier(2)

    def run(name: str) -> None:
        started.wait()
        DemoCache(tmp_path / "cache").build(
            "m", {}, tmp_path / name, _counting(tmp_path / name, calls), print
        )

    threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert calls == [1]
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")


def test_no_cache_builds_every_time(tmp_path: Path) -> None:
    calls: list[int] = []
    for name in ("a", "b"):
        DemoCache(None).build("m", {}, tmp_path / name, _counting(tmp_path / name, calls), print)
    assert calls == [1, 1]


def test_a_real_demo_model_from_the_cache_is_the_one_built(tmp_path: Path) -> None:
    cache = DemoCache(tmp_path / "cache")

    def build(out: Path):
        def run() -> Built:
            demo = build_demo_model("iris", out)
            return Built(demo.path, demo.framework, demo.metadata, demo.description)

        return run

    built = cache.build("iris", {}, tmp_path / "a" / "iris", build(tmp_path / "a"), print)
    copied = cache.build("iris", {}, tmp_path / "b" / "iris", build(tmp_path / "b"), print)
    assert _digest(copied.folder) == _digest(built.folder)
    assert copied.metadata == built.metadata


def test_the_setting_turns_it_off_and_defaults_to_the_user_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert Settings().demo_cache_dir == tmp_path / "inferd" / "demo"
    monkeypatch.setenv("INFERD_DEMO_CACHE_DIR", "")
    assert Settings().demo_cache_dir is None
