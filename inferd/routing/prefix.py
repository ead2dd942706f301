"""Prefix-aware choice among a generative version's replicas.

A replica's engine keeps the keys and values of the prompts it computed (prefix
caching); a later prompt that starts the same way (the next turn of a chat, a shared
system prompt) costs only its new part there, and all of it anywhere else. So with more
than one replica, a generation should go where its longest prefix was sent before.

The gateway holds no tokenizer, so it cannot key blocks of tokens as the engines do; it
keys the prompt as the chat template will see it instead -- the tools, then each
message, each encoded the same way every time, or the text, or the token ids -- in
blocks of ``BYTES_PER_TOKEN x llm.block_size`` bytes (about an engine block of English
text), each key a hash chained to the one before (:func:`prompt_keys`). Equal keys mean
equal prompt beginnings, which the template renders and the tokenizer encodes to equal
token beginnings, which the engine's cache holds as long as it did not evict them.

Where each key went is a :class:`PrefixIndex` every gateway process keeps: filled by
what it sends, and by what every replica reports it was sent by any gateway (the keys
travel in the ``Generate`` frame and come back in the replica's ``Load`` frames), so
gateway processes and hosts choose alike. A preferred replica loses the preference when
its engine holds more than its fair share of the version's load by a margin
(``llm.prefix_routing_margin``), or its KV cache is nearly full: a cached prefix is not
worth a long queue. And a replica running fewer sequences takes the generation while it
lacks little more of the prompt (``llm.prefix_routing_move_tokens``): a chat's first
turns even the load out, where moving a long history would cost more than it saves.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Any

import msgspec

BYTES_PER_TOKEN = 4
"""What the gateway, which holds no tokenizer, takes a token to be in prompt bytes:
about right for English text. Its blocks are ``BYTES_PER_TOKEN x llm.block_size``."""
MAX_KEYS = 256
"""Keys of a prompt's first blocks at most (16 KiB of prompt at 64-byte blocks): the
beginnings are what is shared; the cost stays bounded for long prompts."""
INDEX_KEYS = 65_536
"""Keys a gateway process remembers (least recently sent forgotten first)."""
HOLDERS = 4
"""Replicas remembered per key, most recent first."""

_json = msgspec.json.Encoder(order="deterministic")


def prompt_bytes(prompt: str | list[int] | dict[str, Any], adapter: str | None) -> bytes:
    """A prompt as the keys see it: what the chat template renders in order, so a chat's
    next turn starts with this turn's bytes."""
    head = b"adapter:%s\x00" % adapter.encode() if adapter else b""
    if isinstance(prompt, str):
        return head + prompt.encode()
    if isinstance(prompt, list):
        return head + array("q", prompt).tobytes()
    parts = [head, _json.encode(prompt.get("tools") or []), b"\x00"]
    for message in prompt.get("messages") or ():
        parts.append(_json.encode(message))
        parts.append(b"\x1e")
    return b"".join(parts)


def prompt_keys(data: bytes, block_bytes: int) -> list[int]:
    """Chained 64-bit keys of the full ``block_bytes`` blocks of ``data``."""
    keys: list[int] = []
    parent = b""
    for at in range(0, min(len(data) // block_bytes, MAX_KEYS) * block_bytes, block_bytes):
        parent = hashlib.blake2b(parent + data[at : at + block_bytes], digest_size=8).digest()
        keys.append(int.from_bytes(parent, "little"))
    return keys


class PrefixIndex:
    """Key -> the replicas it was sent to, most recent first; bounded, least recently
    sent forgotten first."""

    def __init__(self, max_keys: int = INDEX_KEYS) -> None:
        self.max_keys = max_keys
        self._holders: OrderedDict[int, tuple[str, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def add(self, keys: list[int], replica: str) -> None:
        holders = self._holders
        for key in keys:
            known = holders.pop(key, ())
            if not known or known[0] != replica:
                known = (replica, *(r for r in known if r != replica))[:HOLDERS]
            holders[key] = known
        while len(holders) > self.max_keys:
            holders.popitem(last=False)

    def holders(self, key: int) -> tuple[str, ...]:
        return self._holders.get(key, ())

    def forget(self, replica: str) -> None:
        """A replica that is gone holds nothing (its successor starts with an empty cache)."""
        for key, known in list(self._holders.items()):
            if replica in known:
                rest = tuple(r for r in known if r != replica)
                if rest:
                    self._holders[key] = rest
                else:
                    del self._holders[key]
