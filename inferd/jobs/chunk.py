"""The job queue's message: a chunk of one job's inputs. The gateway's
:class:`~inferd.jobs.Jobs` writes it, the server's runner reads it; it lives apart from
the runner so that a gateway imports neither the runner nor its HTTP client."""

from __future__ import annotations

import msgspec


class Chunk(msgspec.Struct, array_like=True):
    """One queue message: items ``start`` … ``start + len(items) - 1`` of a job, each
    the raw JSON of one input (kept raw: a malformed one fails alone, at run time)."""

    job_id: str
    start: int
    items: list[bytes]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Chunk)


def encode_chunk(chunk: Chunk) -> bytes:
    return _encoder.encode(chunk)


def decode_chunk(payload: bytes) -> Chunk:
    return _decoder.decode(payload)
