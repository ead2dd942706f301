"""The frames between the server and its fork server (:mod:`inferd.serving.zygote`), one
message each on a ``SOCK_SEQPACKET`` socket pair (MessagePack; a :class:`Forked`
carries the child's pidfd as ancillary data)."""

from __future__ import annotations

import msgspec


class Fork(msgspec.Struct, tag="fork", frozen=True, kw_only=True):
    """Start one replica process, forked from the fork server."""

    request_id: int
    spec: str
    """The replica's :class:`~inferd.shapes.replica_spec.ReplicaSpec` as JSON (its
    command line, as a process started from scratch gets it)."""
    grace_s: float
    framework: str
    """Imported into the fork server before it forks (once per framework), so that this
    replica and the next ones of it start with their framework loaded."""
    threads: int
    env: dict[str, str]
    """The child's whole environment."""


class Forked(msgspec.Struct, tag="forked", frozen=True, kw_only=True):
    """The replica's process runs (its pidfd rides along)."""

    request_id: int
    pid: int


class Failed(msgspec.Struct, tag="failed", frozen=True, kw_only=True):
    """The fork server could not fork (the server starts the replica itself then)."""

    request_id: int
    message: str


class Exited(msgspec.Struct, tag="exited", frozen=True, kw_only=True):
    """A replica process the fork server forked has ended (it reaped it)."""

    pid: int
    code: int
    """As :attr:`asyncio.subprocess.Process.returncode`: the exit status, or minus the
    signal that killed it."""


Frame = Fork | Forked | Failed | Exited
MAX_FRAME = 1 << 20
"""A frame's largest size (a spec and an environment): the receiving buffer."""
_decoder = msgspec.msgpack.Decoder(Frame)
_encoder = msgspec.msgpack.Encoder()


def encode(frame: Frame) -> bytes:
    return _encoder.encode(frame)


def decode(data: bytes) -> Frame:
    return _decoder.decode(data)
