"""The job record on SQLite and the machine's PostgreSQL: idempotent results, counters
that move by what was inserted, a job that finishes exactly once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import update

from inferd.jobs import new_job_id
from inferd.jobs.store import JobStore, Result
from inferd.registry import Registry
from inferd.registry.tables import jobs


def _job(store: JobStore, total: int, **kw: object) -> str:
    job_id = new_job_id("batch")
    store.create(job_id, "batch", "m", None, total, {"route": "predict"}, "batch", None, None,
                 kw.get("keep_s", 3600.0))  # type: ignore[arg-type]  # fmt: skip
    return job_id


def _ok(item: int) -> Result:
    return Result(item, 200, f'{{"y": {item}}}')


def test_results_are_idempotent_and_the_job_finishes_once(registry: Registry):
    store = JobStore(registry.engine)
    job_id = _job(store, 5)
    assert store.get(job_id)["status"] == "accepting"
    store.accepted(job_id)
    store.start(job_id)
    assert store.get(job_id)["status"] == "running"
    assert not store.add_results(job_id, [_ok(0), _ok(1), Result(2, 422, '{"error": {}}')])
    # the same chunk delivered again (a crash before its ack): nothing moves
    assert not store.add_results(job_id, [_ok(0), _ok(1), Result(2, 422, '{"error": {}}')])
    job = store.get(job_id)
    assert (job["succeeded"], job["failed"], job["status"]) == (2, 1, "running")
    assert store.add_results(job_id, [_ok(1), _ok(3), _ok(4)])  # completes it
    assert not store.add_results(job_id, [_ok(4)])  # and only once
    job = store.get(job_id)
    assert (job["succeeded"], job["failed"], job["status"]) == (4, 1, "succeeded")
    assert job["finished_at"] is not None
    assert [r[0] for r in store.results_page(job_id, -1, 10)] == [0, 1, 2, 3, 4]
    assert [r[0] for r in store.results_page(job_id, 1, 2)] == [2, 3]
    assert store.results_page(job_id, 1, 2)[0][1] == 422
    assert not store.finish(job_id, "cancelled")  # over already


def test_concurrent_writers_of_the_same_chunk_count_it_once(registry: Registry):
    """Two runners finishing the same redelivered chunk at the same time."""
    store = JobStore(registry.engine)
    job_id = _job(store, 200)
    chunk = [_ok(i) for i in range(200)]
    with ThreadPoolExecutor(4) as pool:
        finished = list(pool.map(lambda _: store.add_results(job_id, chunk), range(4)))
    assert finished.count(True) == 1
    job = store.get(job_id)
    assert (job["succeeded"], job["status"]) == (200, "succeeded")
    assert store.count_results(job_id) == 200


def test_cancel_interrupted_and_expired(registry: Registry):
    store = JobStore(registry.engine)
    cancelled = _job(store, 3)
    store.accepted(cancelled)
    assert store.finish(cancelled, "cancelled", "by the client")
    assert store.get(cancelled)["status"] == "cancelled"
    assert not store.add_results(cancelled, [_ok(0), _ok(1), _ok(2)])
    assert store.get(cancelled)["status"] == "cancelled"  # results do not revive it

    interrupted = _job(store, 3)  # never accepted: its gateway died while queueing
    old = datetime.now(UTC) - timedelta(hours=1)
    with registry.engine.begin() as conn:
        conn.execute(update(jobs).where(jobs.c.id == interrupted).values(created_at=old))
    assert store.fail_interrupted(older_than_s=600) == 1
    assert store.get(interrupted)["status"] == "failed"

    expired = _job(store, 1, keep_s=0.001)
    store.add_results(expired, [_ok(0)])
    assert store.purge() >= 1
    assert store.get(expired) is None and store.results_page(expired, -1, 10) == []
    assert store.get(cancelled) is not None  # kept until its own expiry


def test_files_and_a_batch_s_output_lines(registry: Registry, tmp_path: Path):
    from inferd.config import JobsConfig
    from inferd.jobs import output_file_id, output_of
    from inferd.jobs.files import FileStore, Upload, output_lines, output_size

    files, root, cfg = FileStore(registry.engine), (tmp_path / "files").as_uri(), JobsConfig()

    def upload(name: str, content: bytes) -> Upload:
        (tmp_path / name).write_bytes(content)
        return Upload(tmp_path / name, {}, name, len(content), "", False)

    content = b'{"custom_id": "a"}\n' + bytes(range(256))  # kept byte for byte
    first = files.create(upload("in.jsonl", content), "batch", "key:alice", 3600, root, cfg)
    second = files.create(upload("other.jsonl", b"x\n"), "batch", None, 3600, root, cfg)
    assert files.get(first["id"])["bytes"] == len(content)
    with files.open(first["id"]) as opened:
        assert opened.read() == content
    assert [f["id"] for f in files.find("batch", None, None, 10, True)] == [
        second["id"], first["id"]
    ]  # fmt: skip
    assert [f["id"] for f in files.find(None, "key:alice", None, 10, True)] == [first["id"]]
    assert [f["id"] for f in files.find("batch", None, first["id"], 10, False)] == [second["id"]]
    assert files.delete(first["id"]) and not files.delete(first["id"])
    assert files.get(first["id"]) is None and not (tmp_path / "files" / first["id"]).exists()

    store = JobStore(registry.engine)
    job_id = _job(store, 4)
    store.add_results(job_id, [_ok(0), Result(1, 400, '{"e": 1}'), _ok(2), _ok(3)])
    assert output_of(output_file_id(job_id, True)) == (job_id, True)
    assert output_of(output_file_id(job_id, False)) == (job_id, False)
    assert output_of(second["id"]) is None
    lines = b"".join(output_lines(store, job_id, errors=False, page=2))
    assert lines == b'{"y": 0}\n{"y": 2}\n{"y": 3}\n'
    assert b"".join(output_lines(store, job_id, errors=True)) == b'{"e": 1}\n'
    assert output_size(store, job_id, errors=False) == len(lines)
