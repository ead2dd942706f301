"""Fewer system calls per request: a response's head goes out with its body
(api/http_protocol.py), and the frames of one event-loop turn to a replica, or from it,
go in one write (serving/protocol.py TurnWriter). Each is checked on a transport that
records its writes, so what is written, in which order, and in how many writes is exact."""

from __future__ import annotations

import asyncio

from inferd.api.http_protocol import _HeadWithBody
from inferd.shapes.replica import TurnWriter


class Recorder:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> str:
        return f"info {name}"


HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


async def _turn() -> None:
    """Let the loop finish this turn and run the callbacks it scheduled."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


def test_a_head_goes_out_with_the_body_written_in_the_same_turn() -> None:
    async def main() -> list[bytes]:
        transport = Recorder()
        writer = _HeadWithBody(transport, asyncio.get_running_loop())  # type: ignore[arg-type]
        writer.write(HEAD)
        assert transport.writes == []
        writer.write(b"ok")
        await _turn()
        return transport.writes

    assert asyncio.run(main()) == [HEAD + b"ok"]


def test_a_head_without_a_body_in_its_turn_goes_out_at_the_end_of_it() -> None:
    # a streaming response: the first chunk is not ready yet; the head must not wait for it
    async def main() -> Recorder:
        transport = Recorder()
        writer = _HeadWithBody(transport, asyncio.get_running_loop())  # type: ignore[arg-type]
        writer.write(HEAD)
        await _turn()
        assert transport.writes == [HEAD]
        writer.write(b"chunk 1")
        writer.write(b"chunk 2")
        writer.write(HEAD)  # the next response on the connection
        writer.close()  # the head it holds goes out before the close
        return transport

    transport = asyncio.run(main())
    assert transport.writes == [HEAD, b"chunk 1", b"chunk 2", HEAD]
    assert transport.closed


def test_the_rest_of_the_transport_is_the_transports() -> None:
    async def main() -> str:
        writer = _HeadWithBody(Recorder(), asyncio.get_running_loop())  # type: ignore[arg-type]
        return writer.get_extra_info("peername")  # type: ignore[no-any-return]

    assert asyncio.run(main()) == "info peername"


def test_a_turns_frames_go_in_one_write_after_the_first() -> None:
    async def main() -> list[bytes]:
        transport = Recorder()
        writer = TurnWriter(transport)
        writer.write(b"1")  # alone so far: at once, not delayed
        assert transport.writes == [b"1"]
        writer.write(b"2")
        writer.write(b"3")
        assert transport.writes == [b"1"]
        await _turn()
        writer.write(b"4")  # a new turn: at once again
        await _turn()
        return transport.writes

    assert asyncio.run(main()) == [b"1", b"23", b"4"]


def test_frames_left_for_a_closed_transport_are_dropped() -> None:
    async def main() -> list[bytes]:
        transport = Recorder()
        writer = TurnWriter(transport)
        writer.write(b"1")
        writer.write(b"2")
        transport.close()
        await _turn()
        return transport.writes

    assert asyncio.run(main()) == [b"1"]
