"""Request bodies for the load generator: fixed, from a JSONL file, or from a template.

Every source hands out ready-to-send UTF-8 JSON bytes from ``next()``. The load loop
calls it once per request on the same cores as the server under test, so the work
per call is kept to the minimum: files are parsed and encoded once at load, and a
template is compiled once into the list of slots to refill, after which ``next()`` is
only the random draws plus one ``orjson.dumps``.

Template placeholders (a JSON string value that is *entirely* a placeholder; there is
no interpolation inside a longer string, and a known placeholder embedded in one is an
error rather than being sent literally)::

    "{{int:LO:HI}}"        random integer, LO <= n <= HI
    "{{float:LO:HI}}"      random float, uniform in [LO, HI]
    "{{floats:N:LO:HI}}"   list of N such floats (a feature vector)
    "{{choice:a|b|c}}"     one of the strings, uniformly
    "{{words:N}}"          N random common English words separated by spaces
    "{{prompt}}"           a prompt whose length is drawn from a PromptLengths
    "{{uuid}}"             a random (seedable) UUID4 string

Prompts are made of common English words, each of which is a single token with a
leading space for GPT-2-style BPE tokenizers, so a prompt of N words is *approximately*
N tokens (1 word ~ 1 token); chat templates and special tokens add a few more.
"""

from __future__ import annotations

import itertools
import random
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson


class PayloadSource(Protocol):
    """Hands out request bodies, one per call."""

    def next(self) -> bytes:
        """The next body: JSON, UTF-8 encoded."""
        ...


class FixedPayload:
    """The same body every time."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    def next(self) -> bytes:
        return self.body


def fixed(body: bytes | dict[str, Any]) -> FixedPayload:
    """A constant body; bytes must already be valid JSON (checked here, not per request)."""
    if isinstance(body, dict):
        return FixedPayload(orjson.dumps(body))
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"body is not valid JSON: {exc}") from exc
    return FixedPayload(bytes(body))


class JsonlPayloads:
    """One JSON body per non-empty line of a file, handed out in order, cycled forever."""

    def __init__(self, path: Path) -> None:
        bodies = []
        for lineno, raw in enumerate(Path(path).read_bytes().splitlines(), start=1):
            line = raw.strip()
            if not line:
                continue
            try:
                orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {exc}") from exc
            bodies.append(line)
        if not bodies:
            raise ValueError(f"{path}: no request bodies (the file has no non-empty lines)")
        self.size = len(bodies)
        self._bodies = itertools.cycle(bodies)

    def next(self) -> bytes:
        return next(self._bodies)


# --- prompt lengths ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PromptLengths:
    """A distribution of prompt lengths in tokens (approximately: 1 word ~ 1 token).

    Parsed from ``"32"`` (fixed), ``"uniform:LO:HI"`` (integers, both inclusive) or
    ``"normal:MEAN:STD"`` (rounded, clipped to >= 1).
    """

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> PromptLengths:
        kind, _, rest = text.strip().partition(":")
        try:
            if not rest:
                lengths = cls("fixed", int(kind))
            else:
                low, high = rest.split(":")
                if kind == "uniform":
                    lengths = cls("uniform", int(low), int(high))
                elif kind == "normal":
                    lengths = cls("normal", float(low), float(high))
                else:
                    raise ValueError(f"unknown distribution {kind!r}")
        except ValueError as exc:
            raise ValueError(
                f"invalid prompt length {text!r} ({exc}): expected N, uniform:LO:HI "
                "or normal:MEAN:STD, e.g. 'uniform:16:256'"
            ) from exc
        lengths._check(text)
        return lengths

    def _check(self, text: str) -> None:
        if self.kind in {"fixed", "uniform"} and self.a < 1:
            raise ValueError(f"invalid prompt length {text!r}: lengths must be >= 1")
        if self.kind == "uniform" and self.b < self.a:
            raise ValueError(f"invalid prompt length {text!r}: HI must be >= LO")
        if self.kind == "normal" and self.b < 0:
            raise ValueError(f"invalid prompt length {text!r}: STD must be >= 0")

    def draw(self, rng: random.Random) -> int:
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        if self.kind == "normal":
            return max(1, round(rng.gauss(self.a, self.b)))
        return int(self.a)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        return f"{self.kind}:{self.a:g}:{self.b:g}"


# --- templates ---------------------------------------------------------------------------

_WORD_TEXT = """
    the of and to in is that for it as was with be by on not he this are or his from at
    which but have an had they you were their one all we can her has there been if more
    when will would who so no she other its about out many then them these some time up
    into two may only could over such our new first also years after most made like
    people any state between where what world work how way year well three even because
    very part both through those use back used must before just great while since during
    life did now own same each much still under day long good water house city school
    place small family number know take see come think look want give find tell ask feel
    try leave call keep let show hear play run move live believe hold bring write stand
    turn start might should never always often again here today best last next few
    little old big high right different large young important public bad able hand home
    country week company system program question government night point group problem
    fact money story month book word business side kind head friend power hour game line
    end member law car name team minute idea body information face level office door
    health person art war history party result change morning reason research girl
    moment air teacher force education light music market road food room child woman man
    mother father area order sense service land open real free sure black white red
    green blue short late early simple clear full true whole low
"""
WORDS = tuple(_WORD_TEXT.split())
"""~270 common English words, each one GPT-2 BPE token when preceded by a space."""

_Render = Callable[[], Any]
_WHOLE = re.compile(r"\{\{\s*([A-Za-z_]\w*)(?::(.*?))?\s*\}\}", re.DOTALL)
_KINDS = ("int", "float", "floats", "choice", "words", "prompt", "uuid")
_EMBEDDED = re.compile(r"\{\{\s*(?:" + "|".join(_KINDS) + r")\s*(?::|\}\})")


class TemplatePayloads:
    """Bodies rendered from a JSON template with placeholders (see the module docstring).

    The template is compiled once; each ``next()`` refills the placeholder slots of one
    private copy of the document in place and encodes it. That makes a source cheap but
    not thread-safe: use one per thread (one per asyncio event loop is fine).
    """

    def __init__(
        self,
        template: str | dict[str, Any],
        seed: int | None = None,
        prompt_lengths: PromptLengths | None = None,
    ) -> None:
        self._rng = random.Random(seed)
        self._prompt_lengths = prompt_lengths
        try:
            # A private deep copy: rendering writes into it.
            doc = orjson.loads(template if isinstance(template, str) else orjson.dumps(template))
        except (orjson.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"template is not valid JSON: {exc}") from exc
        self._root: list[Any] = [doc]
        self._slots: list[tuple[Any, Any, _Render]] = []
        self._bind(self._root, 0)

    def next(self) -> bytes:
        for parent, key, render in self._slots:
            parent[key] = render()
        return orjson.dumps(self._root[0])

    def _bind(self, parent: Any, key: Any) -> None:
        value = parent[key]
        if isinstance(value, dict):
            for child in value:
                self._bind(value, child)
        elif isinstance(value, list):
            for index in range(len(value)):
                self._bind(value, index)
        elif isinstance(value, str):
            render = self._compile(value)
            if render is not None:
                self._slots.append((parent, key, render))

    def _compile(self, text: str) -> _Render | None:
        match = _WHOLE.fullmatch(text)
        if match is None:
            if _EMBEDDED.search(text):
                raise ValueError(
                    f"placeholder inside a longer string {text!r}: a placeholder must be "
                    'the whole string value, e.g. "prompt": "{{prompt}}"'
                )
            return None
        kind, args = match.group(1), match.group(2)
        factory = _FACTORIES.get(kind)
        if factory is None:
            raise ValueError(f"unknown placeholder {text!r}; known: {', '.join(_KINDS)}")
        try:
            return factory(self, args.split(":") if args else [])
        except ValueError as exc:
            raise ValueError(f"invalid placeholder {text!r}: {exc}") from exc

    # Each factory validates its arguments once and returns a closure over the rng.

    def _int(self, args: list[str]) -> _Render:
        low, high = (int(a) for a in _arity(args, 2, "LO:HI"))
        _ordered(low, high)
        randint = self._rng.randint
        return lambda: randint(low, high)

    def _float(self, args: list[str]) -> _Render:
        low, high = (float(a) for a in _arity(args, 2, "LO:HI"))
        _ordered(low, high)
        uniform = self._rng.uniform
        return lambda: uniform(low, high)

    def _floats(self, args: list[str]) -> _Render:
        count, low_text, high_text = _arity(args, 3, "N:LO:HI")
        n, low, high = _positive(count), float(low_text), float(high_text)
        _ordered(low, high)
        random_ = self._rng.random
        span = high - low
        return lambda: [low + span * random_() for _ in range(n)]

    def _choice(self, args: list[str]) -> _Render:
        # Options may themselves contain ':', so re-join what the caller split.
        options = ":".join(args).split("|")
        if not args or not any(options):
            raise ValueError("expected choice:a|b|c")
        choice = self._rng.choice
        return lambda: choice(options)

    def _words(self, args: list[str]) -> _Render:
        n = _positive(_arity(args, 1, "N")[0])
        choices = self._rng.choices
        return lambda: " ".join(choices(WORDS, k=n))

    def _prompt(self, args: list[str]) -> _Render:
        _arity(args, 0, "no arguments")
        lengths = self._prompt_lengths
        if lengths is None:
            raise ValueError("{{prompt}} needs prompt_lengths (e.g. PromptLengths.parse('128'))")
        rng = self._rng
        return lambda: " ".join(rng.choices(WORDS, k=lengths.draw(rng)))

    def _uuid(self, args: list[str]) -> _Render:
        _arity(args, 0, "no arguments")
        getrandbits = self._rng.getrandbits
        # Built from the seeded rng, unlike uuid.uuid4(), so a seeded run is reproducible.
        return lambda: str(uuid.UUID(int=getrandbits(128), version=4))


_FACTORIES: dict[str, Callable[[TemplatePayloads, list[str]], _Render]] = {
    "int": TemplatePayloads._int,
    "float": TemplatePayloads._float,
    "floats": TemplatePayloads._floats,
    "choice": TemplatePayloads._choice,
    "words": TemplatePayloads._words,
    "prompt": TemplatePayloads._prompt,
    "uuid": TemplatePayloads._uuid,
}


def _arity(args: list[str], n: int, expected: str) -> list[str]:
    if len(args) != n:
        raise ValueError(f"expected {expected}")
    return args


def _ordered(low: float, high: float) -> None:
    if high < low:
        raise ValueError(f"HI ({high}) must be >= LO ({low})")


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise ValueError(f"N must be >= 1, got {n}")
    return n
