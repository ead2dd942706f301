"""A payload sink that produces each row to a Kafka topic (aiokafka), in the CloudEvents
Kafka binding's binary content mode: the attributes as ``ce_*`` headers, ``content-type``
``application/json``, the value the JSON data; no key (the producer spreads records and
batches them freely; an event's ``id`` is in its headers).

``kafka://host:9092[,host:9092]/topic`` (default topic ``inferd.inference-log``).
aiokafka is asynchronous: the sink keeps a private event loop that only its thread runs,
and a batch is one ``send`` per row then one wait for every acknowledgement (``acks``
all), within ``timeout_s``. A producer that failed is stopped and made anew at the next
batch."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from inferd.config import PayloadLogConfig
from inferd.monitoring.sinks import display_name
from inferd.monitoring.sinks.events import EventEncoder
from inferd.shapes.logs import LogRow

DEFAULT_TOPIC = "inferd.inference-log"
Record = tuple[bytes, list[tuple[str, bytes]]]
"""A Kafka record's value and headers."""


def record(encoder: EventEncoder, row: LogRow) -> Record:
    """A row as a binary-mode CloudEvent record: its value and headers."""
    headers = [
        ("content-type" if name == "datacontenttype" else f"ce_{name}", value.encode())
        for name, value in encoder.attributes(row).items()
    ]
    return encoder.encode(encoder.data(row)), headers


class KafkaSink:
    def __init__(self, uri: str, cfg: PayloadLogConfig, encoder: EventEncoder) -> None:
        parts = urlsplit(uri)
        if not parts.netloc:
            raise ValueError(f"payload sink {uri!r}: expected kafka://host:port[/topic]")
        self.bootstrap = parts.netloc.split(",")
        self.topic = parts.path.strip("/") or DEFAULT_TOPIC
        self.name = display_name(f"kafka://{parts.netloc}/{self.topic}")
        self.encoder = encoder
        self.timeout_s = cfg.timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._producer: Any = None

    def send(self, rows: Sequence[LogRow]) -> None:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(asyncio.wait_for(self._send(rows), self.timeout_s))
        except BaseException:
            self._loop.run_until_complete(self._stop_producer())  # a fresh one next time
            raise

    async def _send(self, rows: Sequence[LogRow]) -> None:
        producer = await self._started()
        acks = []
        for row in rows:
            value, headers = record(self.encoder, row)
            acks.append(await producer.send(self.topic, value=value, headers=headers))
        await asyncio.gather(*acks)

    async def _started(self) -> Any:
        if self._producer is None:
            from aiokafka import AIOKafkaProducer

            timeout_ms = int(self.timeout_s * 1000)
            producer = AIOKafkaProducer(
                bootstrap_servers=self.bootstrap, acks="all", linger_ms=5,
                request_timeout_ms=timeout_ms, client_id="inferd-payload-log",
            )  # fmt: skip
            try:
                await producer.start()
            except BaseException:
                await producer.stop()
                raise
            self._producer = producer
        return self._producer

    async def _stop_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                await producer.stop()

    def close(self) -> None:
        if self._loop is not None:
            self._loop.run_until_complete(self._stop_producer())
            self._loop.close()
