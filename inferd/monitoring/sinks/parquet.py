"""A payload sink that writes each batch as Parquet files to an S3-compatible store.

``s3://bucket/prefix``: a batch's rows go to one file per UTC day among them, under
``prefix/dt=YYYY-MM-DD/`` (Hive-style, so Athena, Spark, DuckDB and pyarrow read the
folder as a table partitioned by ``dt``). Columns are the row's, as the database keeps
them (the user key as its hash; ``timestamp`` a UTC timestamp), and ``payload``: the
sampled bodies as the events carry them, as JSON text (null when not sampled). Files
are zstd-compressed. A file's name is a digest of its first row, so a batch tried
again overwrites what an earlier try wrote instead of adding a copy.

The store is reached as the S3 artifact store reaches it (s3fs; endpoint, region and
credentials the usual AWS way: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, …), with
no retries of its own (the runner retries) and ``timeout_s`` to connect and to read.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import msgspec.inspect as mi
import pyarrow as pa
import pyarrow.parquet as pq

from inferd.config import PayloadLogConfig
from inferd.monitoring.sinks import display_name
from inferd.monitoring.sinks.events import EventEncoder
from inferd.shapes.logs import NOT_COLUMNS, LogRow

_ARROW: dict[type, pa.DataType] = {
    mi.IntType: pa.int64(), mi.FloatType: pa.float64(), mi.StrType: pa.string(),
    mi.BoolType: pa.bool_(),
}  # fmt: skip


def _arrow_type(info: Any) -> pa.DataType:
    if isinstance(info, mi.UnionType):  # X | None: a nullable X
        (info,) = [t for t in info.types if not isinstance(t, mi.NoneType)]
    return _ARROW[type(info)]


def schema() -> pa.Schema:
    """The files' columns, from :class:`LogRow`'s fields (a new field is a new column)."""
    fields = []
    for field in mi.type_info(LogRow).fields:  # type: ignore[attr-defined]
        if field.name in NOT_COLUMNS:
            continue
        if field.name == "timestamp":
            fields.append(pa.field("timestamp", pa.timestamp("us", tz="UTC"), nullable=False))
        elif field.name == "user":
            fields.append(pa.field("user_hash", pa.string()))
        else:
            fields.append(pa.field(field.name, _arrow_type(field.type)))
    return pa.schema([*fields, pa.field("payload", pa.string())])


SCHEMA = schema()
_PLAIN = frozenset(SCHEMA.names) - {"timestamp", "payload"}
"""Columns that are the event data's fields as they are."""


def table(encoder: EventEncoder, rows: Sequence[LogRow]) -> pa.Table:
    """``rows`` as one Arrow table of :data:`SCHEMA`."""
    columns: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    fields = [(name, values) for name, values in columns.items() if name in _PLAIN]
    for row in rows:
        data = encoder.data(row)
        for name, values in fields:
            values.append(getattr(data, name))
        columns["timestamp"].append(int(row.timestamp * 1_000_000))
        payload = data.payload
        columns["payload"].append(None if payload is None else encoder.encode(payload).decode())
    return pa.table(
        [pa.array(values, type=SCHEMA.field(name).type) for name, values in columns.items()],
        schema=SCHEMA,
    )


class S3ParquetSink:
    def __init__(self, uri: str, cfg: PayloadLogConfig, encoder: EventEncoder) -> None:
        parts = urlsplit(uri)
        if not parts.netloc:
            raise ValueError(f"payload sink {uri!r}: expected s3://bucket[/prefix]")
        self.root = f"{parts.netloc}/{parts.path.strip('/')}".rstrip("/")
        self.name = display_name(uri)
        self.encoder = encoder
        self.timeout_s = cfg.timeout_s
        self.writer = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{encoder.host}-{os.getpid()}")
        self._fs: Any = None

    @property
    def fs(self) -> Any:
        if self._fs is None:
            import s3fs

            config = {"connect_timeout": self.timeout_s, "read_timeout": self.timeout_s,
                      "retries": {"max_attempts": 1}}  # fmt: skip
            self._fs = s3fs.S3FileSystem(config_kwargs=config, skip_instance_cache=True)
        return self._fs

    def key(self, rows: Sequence[LogRow]) -> str:
        """Where ``rows`` (one day's) go: ``dt=`` their day, then a name that is the same
        for the same rows (a retry overwrites)."""
        first = rows[0]
        when = datetime.fromtimestamp(first.timestamp, UTC)
        digest = hashlib.blake2b(
            f"{first.request_id}\0{first.timestamp!r}\0{len(rows)}".encode(), digest_size=8
        ).hexdigest()
        name = f"{when:%Y%m%dT%H%M%S}-{self.writer}-{digest}.parquet"
        return f"{self.root}/dt={when:%Y-%m-%d}/{name}"

    def send(self, rows: Sequence[LogRow]) -> None:
        days: defaultdict[str, list[LogRow]] = defaultdict(list)
        for row in rows:
            days[datetime.fromtimestamp(row.timestamp, UTC).strftime("%Y-%m-%d")].append(row)
        for group in days.values():
            sink = pa.BufferOutputStream()
            pq.write_table(table(self.encoder, group), sink, compression="zstd")
            self.fs.pipe_file(self.key(group), sink.getvalue().to_pybytes())

    def close(self) -> None:
        self._fs = None
