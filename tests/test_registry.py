"""The model registry against real databases: SQLite files and a PostgreSQL server.

Every test runs on both backends. PostgreSQL tests get a fresh schema each (dropped
afterwards), so they can run concurrently and leave nothing behind. Without a reachable
server they fail, unless INFERD_SKIP_POSTGRES=1 says to skip them.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from datetime import UTC
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import column, insert, inspect, table, text

from inferd.errors import InvalidInput, ModelNotFound, VersionExists
from inferd.registry import ArtifactStore, Registry, schema
from inferd.registry.engine import MIGRATIONS_DIR, _alembic_config
from inferd.registry.store import StagedArtifact
from inferd.registry.tables import (
    JOBS_METADATA,
    Base,
    UTCDateTime,
    feedback,
    inference_logs,
    utcnow,
)
from inferd.shapes.tensors import Signature, TensorSpec

SIGNATURE = Signature(
    inputs=(TensorSpec("features", "FP32", (-1, 3)),),
    outputs=(TensorSpec("prediction", "FP32", (-1,)),),
)


# -- fixtures ----------------------------------------------------------------------


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "model.joblib"
    path.parent.mkdir()
    path.write_bytes(b"not really a model\x00\x01")
    return path


@pytest.fixture
def model_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "src-folder"
    (folder / "tokenizer").mkdir(parents=True)
    (folder / "model.onnx").write_bytes(b"onnx bytes")
    (folder / "tokenizer" / "vocab.txt").write_text("a\nb\n")
    return folder


def push(reg: Registry, name: str, source: Path, version: str, **kwargs: object):
    kwargs.setdefault("framework", "sklearn")
    kwargs.setdefault("signature", SIGNATURE)
    return reg.push(name, source, version, **kwargs)  # type: ignore[arg-type]


def expected_digest(folder: Path) -> str:
    """The documented digest, recomputed independently: sha256 of a sha256sum listing."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    listing = "".join(
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(folder).as_posix()}\n"
        for p in files
    )
    return hashlib.sha256(listing.encode()).hexdigest()


def leftovers(root: Path) -> list[str]:
    """Staging or trash folders left under the artifact root."""
    return sorted(p.name for p in root.rglob(".*"))


# -- schema ------------------------------------------------------------------------


def test_migrate_creates_tables_and_is_idempotent(registry: Registry) -> None:
    tables = set(inspect(registry.engine).get_table_names())
    assert {"models", "model_versions", "alembic_version"} <= tables
    columns = {c["name"] for c in inspect(registry.engine).get_columns("model_versions")}
    assert {"metadata", "signature", "batching", "sha256", "size_bytes"} <= columns
    assert {"tags", "loaded", "owner"} <= {
        c["name"] for c in inspect(registry.engine).get_columns("models")
    }

    registry.migrate()  # already at head: nothing to do, nothing fails
    registry.migrate()
    with registry.engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).all() == [("0014",)]
        # The declarative classes describe exactly what the migrations built (the
        # inference log apart: partitioned on PostgreSQL, described by a Core table).
        context = MigrationContext.configure(conn, opts={"include_name": _registry_only})
        assert compare_metadata(context, Base.metadata) == []
        # and the job tables are what inferd.registry.tables declares
        context = MigrationContext.configure(conn, opts={"include_name": _jobs_only})
        assert compare_metadata(context, JOBS_METADATA) == []
    logged = {c["name"] for c in inspect(registry.engine).get_columns("inference_logs")}
    assert logged == {"id", *inference_logs.c.keys()}
    kept = {c["name"] for c in inspect(registry.engine).get_columns("feedback")}
    assert kept == set(feedback.c.keys())


def _registry_only(name: str | None, type_: str, parents: dict[str, str | None]) -> bool:
    table = name if type_ == "table" else parents.get("table_name")
    return not (table or "").startswith(("inference_logs", "feedback", "job", "files"))


def _jobs_only(name: str | None, type_: str, parents: dict[str, str | None]) -> bool:
    table = name if type_ == "table" else parents.get("table_name")
    return table in ("jobs", "job_results", "files") or type_ == "schema"


def test_upgrade_from_0001_keeps_existing_models_loaded(
    database_url: str, artifact_root: Path
) -> None:
    with Registry(database_url, artifact_root, migrate=False) as reg:
        with reg._write_engine.begin() as conn:
            command.upgrade(_alembic_config(conn), "0001")
            models = table(
                "models",
                column("model_name"),
                column("framework"),
                column("created_at", UTCDateTime()),
            )
            conn.execute(
                insert(models).values(model_name="old", framework="sklearn", created_at=utcnow())
            )
        reg.migrate()
        assert reg.get_model("old").loaded is True


def test_schema_head_is_alembics_head() -> None:
    """``schema.HEAD`` lets a process skip Alembic when the schema is current: it must
    name the newest migration (a new one in migrations/versions moves it)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    assert ScriptDirectory.from_config(config).get_current_head() == schema.HEAD


def test_a_schema_behind_is_upgraded_in_a_child_and_errors_come_back(
    database_url: str, artifact_root: Path
) -> None:
    with Registry(database_url, artifact_root, migrate=False) as reg:
        assert schema.revision(reg.engine) is None
        schema.upgrade_isolated(reg.engine, database_url)
        assert schema.revision(reg.engine) == schema.HEAD
        schema.upgrade_isolated(reg.engine, database_url)  # current: nothing to do
        with reg.write_engine.begin() as conn:  # a revision this inferd does not know
            conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
        with pytest.raises(RuntimeError, match="9999"):
            schema.upgrade_isolated(reg.engine, database_url)


def test_sqlite_connections_use_wal_foreign_keys_and_busy_timeout(tmp_path: Path) -> None:
    with (
        Registry(f"sqlite:///{tmp_path / 'r.db'}", tmp_path / "a") as reg,
        reg.engine.connect() as conn,
    ):
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() > 0


def test_without_migrate_nothing_is_created(tmp_path: Path) -> None:
    with Registry(f"sqlite:///{tmp_path / 'r.db'}", tmp_path / "a", migrate=False) as reg:
        assert inspect(reg.engine).get_table_names() == []


# -- push --------------------------------------------------------------------------


def test_push_file(registry: Registry, model_file: Path, artifact_root: Path) -> None:
    record = push(registry, "fraud", model_file, "v1", metadata={"accuracy": 0.93})

    stored = artifact_root.resolve() / "fraud" / "v1"
    assert record.artifact_path == stored
    assert record.artifact_uri == stored.as_uri()
    assert record.artifact_uri.startswith("file:///")
    assert sorted(p.name for p in stored.iterdir()) == ["inferd.json", "model.joblib"]
    assert (stored / "model.joblib").read_bytes() == model_file.read_bytes()
    # the registry's inferd.json: what the files alone need to answer as this version
    shipped = json.loads((stored / "inferd.json").read_text())
    assert shipped == {"framework": "sklearn", "signature": SIGNATURE.to_dict(), "metadata": {}}
    assert record.size_bytes == model_file.stat().st_size + (stored / "inferd.json").stat().st_size
    assert record.sha256 == expected_digest(stored)
    manifest = json.loads((artifact_root / "fraud" / "v1.manifest.json").read_text())
    file_sha = hashlib.sha256(model_file.read_bytes()).hexdigest()
    assert manifest["files"]["model.joblib"]["sha256"] == file_sha
    assert manifest["sha256"] == record.sha256
    assert record.signature == SIGNATURE
    assert record.metadata == {"accuracy": 0.93}
    assert record.framework == "sklearn"
    assert record.batching is None
    assert record.created_at.utcoffset() is not None
    assert record.created_at.utcoffset().total_seconds() == 0
    assert registry.store.verify("fraud", "v1")
    assert leftovers(artifact_root) == []


def test_push_folder(registry: Registry, model_folder: Path, artifact_root: Path) -> None:
    record = push(registry, "bert", model_folder, "2024-01", framework="onnx")

    stored = record.artifact_path
    assert sorted(p.relative_to(stored).as_posix() for p in stored.rglob("*")) == [
        "inferd.json",
        "model.onnx",
        "tokenizer",
        "tokenizer/vocab.txt",
    ]
    assert record.sha256 == expected_digest(stored)
    assert record.size_bytes == 10 + 4 + (stored / "inferd.json").stat().st_size
    assert registry.store.verify("bert", "2024-01")


def test_digest_depends_only_on_names_and_contents(
    registry: Registry, model_folder: Path, tmp_path: Path
) -> None:
    # The same files written in the opposite order, later: same digest.
    twin = tmp_path / "twin"
    (twin / "tokenizer").mkdir(parents=True)
    (twin / "tokenizer" / "vocab.txt").write_text("a\nb\n")
    (twin / "model.onnx").write_bytes(b"onnx bytes")
    first = push(registry, "bert", model_folder, "v1")
    second = push(registry, "bert", twin, "v2")
    assert first.sha256 == second.sha256
    (twin / "model.onnx").rename(twin / "renamed.onnx")
    assert push(registry, "bert", twin, "v3").sha256 != first.sha256


def test_records_are_json_ready(registry: Registry, model_file: Path) -> None:
    push(registry, "fraud", model_file, "v1", batching={"max_batch_size": 64, "replicas": 2})
    model = registry.get_model("fraud").to_dict()
    decoded = json.loads(json.dumps(model))
    assert decoded["name"] == "fraud"
    assert decoded["created_at"].endswith("+00:00")
    (version,) = decoded["versions"]
    assert version["signature"] == SIGNATURE.to_dict()
    assert version["batching"] == {"max_batch_size": 64, "replicas": 2}
    assert version["created_at"].endswith("+00:00")


@pytest.mark.parametrize(
    "batching",
    [{"max_batch_size": 0}, {"max_wait_ms": "soon"}, {"replicas": 0}, {"bogus": 1}],
)
def test_invalid_batching_rejected(
    registry: Registry, model_file: Path, artifact_root: Path, batching: dict
) -> None:
    with pytest.raises(InvalidInput):
        push(registry, "fraud", model_file, "v1", batching=batching)
    assert registry.list_models() == []
    assert not artifact_root.exists() or not any(artifact_root.rglob("*.json"))


def test_missing_source_rejected(registry: Registry, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="not found"):
        push(registry, "fraud", tmp_path / "nope.joblib", "v1")
    with pytest.raises(InvalidInput, match="no files"):
        (tmp_path / "empty").mkdir()
        push(registry, "fraud", tmp_path / "empty", "v1")
    assert registry.list_models() == []


@pytest.mark.parametrize(
    ("name", "version"),
    [
        ("../etc", "v1"),
        ("a/b", "v1"),
        ("", "v1"),
        (".hidden", "v1"),
        ("x" * 129, "v1"),
        ("fraud\n", "v1"),
        ("fraud", ".."),
        ("fraud", "v1/../../x"),
        ("fraud", "v 1"),
        ("fraud", "v1\n"),
        ("fraud", "v1.manifest.json"),
    ],
)
def test_unsafe_names_rejected(
    registry: Registry, model_file: Path, artifact_root: Path, name: str, version: str
) -> None:
    with pytest.raises(InvalidInput):
        push(registry, name, model_file, version)
    assert registry.list_models() == []
    assert not artifact_root.exists() or list(artifact_root.iterdir()) == []


# -- reads -------------------------------------------------------------------------


def test_list_get_latest(registry: Registry, model_file: Path, model_folder: Path) -> None:
    push(registry, "fraud", model_file, "v1", description="card fraud", owner="risk")
    push(registry, "churn", model_folder, "a", framework="onnx")
    push(registry, "fraud", model_file, "v10")
    push(registry, "fraud", model_file, "v2", owner="risk-team")

    models = registry.list_models()
    assert [m.name for m in models] == ["fraud", "churn"]
    fraud = registry.get_model("fraud")
    assert fraud == models[0]
    assert [v.version for v in fraud.versions] == ["v1", "v10", "v2"]  # registration order
    assert (fraud.framework, fraud.description, fraud.owner) == (
        "sklearn",
        "card fraud",
        "risk-team",
    )
    assert registry.get_model("churn").framework == "onnx"
    assert registry.latest_version("fraud").version == "v2"  # newest, not highest
    assert registry.get_version("fraud", "v10") == fraud.versions[1]


def test_unknown_model_and_version(registry: Registry, model_file: Path) -> None:
    with pytest.raises(ModelNotFound, match="'ghost'") as info:
        registry.get_model("ghost")
    assert info.value.status_code == 404
    assert info.value.to_dict()["error"]["model"] == "ghost"
    with pytest.raises(ModelNotFound, match="'ghost'"):
        registry.latest_version("ghost")
    with pytest.raises(ModelNotFound, match="'ghost'"):
        registry.get_version("ghost", "v1")

    push(registry, "fraud", model_file, "v1")
    with pytest.raises(ModelNotFound, match=r"'v9'.*'fraud'") as info:
        registry.get_version("fraud", "v9")
    assert info.value.details == {"model": "fraud", "version": "v9"}


def test_set_loaded_is_persisted_and_kept_across_pushes(
    database_url: str, artifact_root: Path, model_file: Path
) -> None:
    with Registry(database_url, artifact_root) as first:
        push(first, "fraud", model_file, "v1")
        assert first.get_model("fraud").loaded is True  # the default: served
        first.set_loaded("fraud", False)
        first.set_loaded("fraud", False)  # idempotent
        assert first.get_model("fraud").to_dict()["loaded"] is False
        push(first, "fraud", model_file, "v2")  # a new version does not load it
        with pytest.raises(ModelNotFound, match="'ghost'"):
            first.set_loaded("ghost", True)
    with Registry(database_url, artifact_root) as second:
        assert [(m.name, m.loaded) for m in second.list_models()] == [("fraud", False)]
        second.set_loaded("fraud", True)
        assert second.get_model("fraud").loaded is True


def test_new_registry_sees_the_data(
    database_url: str, artifact_root: Path, model_file: Path
) -> None:
    with Registry(database_url, artifact_root) as first:
        pushed = push(first, "fraud", model_file, "v1", metadata={"dataset": "2024-06"})
    with Registry(database_url, artifact_root) as second:
        assert second.get_version("fraud", "v1") == pushed
        assert [m.name for m in second.list_models()] == ["fraud"]


def push_at_once(
    registries: list[Registry], sources: list[Path], name: str, versions: list[str]
) -> list[object]:
    """Push ``sources[i]`` as ``versions[i]`` from one thread each, released together;
    each outcome is the VersionRecord or the exception raised."""
    barrier = threading.Barrier(len(sources))
    outcomes: list[object] = [None] * len(sources)

    def run(i: int) -> None:
        reg = registries[i % len(registries)]
        barrier.wait()
        try:
            outcomes[i] = push(reg, name, sources[i], versions[i])
        except Exception as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sources))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


# -- immutability and races --------------------------------------------------------


def test_duplicate_push_conflicts_and_keeps_files(
    registry: Registry, model_file: Path, tmp_path: Path, artifact_root: Path
) -> None:
    original = push(registry, "fraud", model_file, "v1")
    other = tmp_path / "other.joblib"
    other.write_bytes(b"a different model")

    with pytest.raises(VersionExists, match=r"'fraud'.*'v1'") as info:
        push(registry, "fraud", other, "v1")
    assert info.value.status_code == 409

    assert registry.get_version("fraud", "v1") == original
    assert sorted(p.name for p in original.artifact_path.iterdir()) == [
        "inferd.json",
        "model.joblib",
    ]
    assert (original.artifact_path / "model.joblib").read_bytes() == model_file.read_bytes()
    assert registry.store.verify("fraud", "v1")
    assert leftovers(artifact_root) == []


@pytest.mark.parametrize("shared", [True, False], ids=["one-registry", "two-registries"])
def test_concurrent_pushes_of_one_version_one_wins(
    database_url: str, artifact_root: Path, tmp_path: Path, shared: bool
) -> None:
    sources = []
    for i in range(2):
        src = tmp_path / f"src{i}" / "model.bin"
        src.parent.mkdir()
        src.write_bytes(f"model from pusher {i}".encode() * 10_000)
        sources.append(src)
    registries = [Registry(database_url, artifact_root) for _ in range(1 if shared else 2)]
    try:
        for round_ in range(5):
            version = f"v{round_}"
            outcomes = push_at_once(registries, sources, "race", [version, version])

            winners = [i for i, o in enumerate(outcomes) if not isinstance(o, Exception)]
            assert len(winners) == 1, outcomes
            assert isinstance(outcomes[1 - winners[0]], VersionExists), outcomes
            stored = registries[0].get_version("race", version)
            assert (stored.artifact_path / "model.bin").read_bytes() == sources[
                winners[0]
            ].read_bytes()
            assert registries[0].store.verify("race", version)
        assert leftovers(artifact_root) == []
    finally:
        for reg in registries:
            reg.close()


def test_concurrent_first_pushes_of_a_new_model_both_succeed(
    database_url: str, artifact_root: Path, model_file: Path
) -> None:
    registries = [Registry(database_url, artifact_root) for _ in range(2)]
    try:
        for round_ in range(3):
            name = f"new{round_}"
            outcomes = push_at_once(registries, [model_file] * 2, name, ["a", "b"])
            assert not [o for o in outcomes if isinstance(o, Exception)], outcomes
            assert {v.version for v in registries[0].get_model(name).versions} == {"a", "b"}
    finally:
        for reg in registries:
            reg.close()


def test_concurrent_migrations_on_a_fresh_database(database_url: str, artifact_root: Path) -> None:
    barrier = threading.Barrier(3)
    errors: list[Exception] = []

    def open_registry() -> None:
        barrier.wait()
        try:
            Registry(database_url, artifact_root).close()
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_registry) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with Registry(database_url, artifact_root, migrate=False) as reg:
        assert {"models", "model_versions"} <= set(inspect(reg.engine).get_table_names())


class RivalPushesWhileCopying(ArtifactStore):
    """A seam: the rival registers the same version after this push's existence check
    passed and its copy finished, i.e. the rival wins the race at the insert."""

    def __init__(self, root: Path, rival: Callable[[], object]) -> None:
        super().__init__(root)
        self.rival = rival

    def stage(
        self, model: str, version: str, source: Path, extra: dict[str, bytes] | None = None
    ) -> StagedArtifact:
        staged = super().stage(model, version, source, extra)
        self.rival()
        return staged


def test_losing_the_race_at_insert_leaves_the_winner_intact(
    database_url: str, artifact_root: Path, model_file: Path, tmp_path: Path
) -> None:
    rival_source = tmp_path / "rival.joblib"
    rival_source.write_bytes(b"the rival's model")
    with (
        Registry(database_url, artifact_root) as rival,
        Registry(database_url, artifact_root) as loser,
    ):
        loser.store = RivalPushesWhileCopying(
            artifact_root, lambda: push(rival, "fraud", rival_source, "v1")
        )
        with pytest.raises(VersionExists):
            push(loser, "fraud", model_file, "v1")

        winner = rival.get_version("fraud", "v1")
        assert sorted(p.name for p in winner.artifact_path.iterdir()) == [
            "inferd.json",
            "rival.joblib",
        ]
        assert rival.store.verify("fraud", "v1")
        assert leftovers(artifact_root) == []


def test_orphaned_folder_from_a_crash_is_replaced(
    registry: Registry, model_file: Path, artifact_root: Path
) -> None:
    # A crash after the rename but before the commit leaves files no row refers to.
    orphan = registry.store.path("fraud", "v1")
    orphan.mkdir(parents=True)
    (orphan / "half.bin").write_bytes(b"junk")

    record = push(registry, "fraud", model_file, "v1")
    assert sorted(p.name for p in record.artifact_path.iterdir()) == [
        "inferd.json",
        "model.joblib",
    ]
    assert registry.store.verify("fraud", "v1")
    assert leftovers(artifact_root) == []


# -- artifact store ----------------------------------------------------------------


def test_verify_detects_tampering(
    registry: Registry, model_folder: Path, artifact_root: Path
) -> None:
    record = push(registry, "bert", model_folder, "v1")
    store = registry.store
    assert store.verify("bert", "v1")

    vocab = record.artifact_path / "tokenizer" / "vocab.txt"
    vocab.write_text("a\nc\n")
    assert not store.verify("bert", "v1")
    vocab.write_text("a\nb\n")
    assert store.verify("bert", "v1")

    (record.artifact_path / "extra.bin").write_bytes(b"")
    assert not store.verify("bert", "v1")
    (record.artifact_path / "extra.bin").unlink()
    assert store.verify("bert", "v1")

    store.manifest_path("bert", "v1").unlink()
    assert not store.verify("bert", "v1")
    assert not store.verify("bert", "never-pushed")


def test_store_put_refuses_to_overwrite_and_delete_removes(
    tmp_path: Path, model_file: Path
) -> None:
    store = ArtifactStore(tmp_path / "store")
    stored = store.put("fraud", "v1", model_file)
    assert stored.path == store.path("fraud", "v1")
    assert stored.sha256 == expected_digest(stored.path)
    with pytest.raises(FileExistsError):
        store.put("fraud", "v1", model_file)
    assert store.verify("fraud", "v1")
    assert leftovers(tmp_path / "store") == []

    store.delete("fraud", "v1")
    assert not stored.path.exists()
    assert not store.manifest_path("fraud", "v1").exists()
    store.delete("fraud", "v1")  # idempotent


def test_from_settings_uses_data_dir(tmp_path: Path, model_file: Path) -> None:
    from inferd.config import Settings

    settings = Settings(data_dir=tmp_path / "data")
    with Registry.from_settings(settings) as reg:
        record = push(reg, "fraud", model_file, "v1")
    assert (tmp_path / "data" / "inferd.db").is_file()
    assert record.artifact_path.is_relative_to((tmp_path / "data" / "artifacts").resolve())
    assert record.created_at.tzinfo is not None
    assert record.created_at.astimezone(UTC) == record.created_at


def test_a_stored_folder_pushed_again_keeps_what_changes_the_answers(
    registry: Registry, model_file: Path
) -> None:
    """Labels (and dtype, pooling, ... : OUTPUT_METADATA) travel in the stored folder's
    inferd.json; other metadata (accuracy) describes that version only."""
    meta = {"labels": ["legit", "fraud"], "accuracy": 0.9, "dtype": "float32"}
    first = push(registry, "fraud", model_file, "v1", metadata=meta)
    again = push(registry, "fraud", first.artifact_path, "v2")
    assert again.metadata == {"labels": ["legit", "fraud"], "dtype": "float32"}
    given = push(registry, "fraud", first.artifact_path, "v3", metadata={"labels": ["a", "b"]})
    assert given.metadata["labels"] == ["a", "b"]  # what the push says wins
    (bad := first.artifact_path.parent / "bad").mkdir()
    (bad / "model.joblib").write_bytes(model_file.read_bytes())
    (bad / "inferd.json").write_text('{"metadata": [1]}')
    with pytest.raises(InvalidInput, match=r"inferd\.json"):
        push(registry, "fraud", bad, "v4")
