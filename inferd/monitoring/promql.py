"""A small PromQL: parser, sample history and instant evaluator.

Why it exists: the console shows the alerts that are firing, computed from the very
expressions of the shipped Prometheus rules (``alerts.yml``), on a server that runs no
Prometheus. So this module evaluates PromQL the way Prometheus 3 does (the version
``compose.yaml`` runs), for the subset those rules use and a little beyond; anything
else is refused with a :class:`PromQLError` rather than answered differently.

Supported:

- Literals (numbers, ``Inf``/``NaN``, hex, strings), unary ``-``/``+``, parentheses.
- Binary operators with Prometheus' precedence: ``or`` < ``and``/``unless`` <
  ``== != > < >= <=`` (optional ``bool``) < ``+ -`` < ``* / %`` < ``^`` (right
  associative; unary minus binds like ``*``). Vector/scalar and vector/vector, one-to-one
  matching with ``on(...)``/``ignoring(...)``, the metric name dropped by arithmetic and
  ``bool`` and never part of a matching signature; set operators ``and or unless``.
- Selectors ``name{l="v", l!="v", l=~"re", l!~"re"}`` (regexes fully anchored), ranges
  ``[5m]`` (``ms s m h d w y``, combined as ``1h30m``), ``offset``.
- Functions ``rate increase irate delta idelta`` (``extrapolatedRate`` of
  ``promql/functions.go``), ``avg/min/max/sum/count_over_time``, ``histogram_quantile``
  (classic buckets, ``promql/quantile.go``), ``abs ceil floor clamp clamp_min clamp_max
  scalar vector time``.
- Aggregations ``sum avg min max count`` with ``by``/``without`` before or after.

Not supported (a clear error): ``group_left``/``group_right``, subqueries, ``@``, other
aggregations and functions. Native histograms are not stored at all.

Semantics kept from Prometheus 3: an instant selector takes the newest sample in
``(t - 5m, t]`` unless the series went stale after it (it was missing from a later
scrape); a range selector takes the samples in ``(t - range, t]``; sums and averages use
Kahan-Neumaier summation; timestamps are integer milliseconds, so results match to the
bit where the arithmetic allows.

:class:`SampleHistory` keeps each series in two arrays (16 bytes a sample) and notes
where a counter last decreased, so that ``rate`` walks a window only when a reset may be
in it: the rules over a few thousand series evaluate in milliseconds.
"""

from __future__ import annotations

import math
import re
from array import array
from bisect import bisect_right
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal, NamedTuple

LOOKBACK_MS = 5 * 60 * 1000
"""Prometheus' default lookback delta: how old the newest sample may be."""

ValueType = Literal["scalar", "vector", "matrix", "string"]


class PromQLError(ValueError):
    """An expression that cannot be parsed or evaluated. ``position`` is the offset
    (0-based) in the expression text for parse errors, else ``None``."""

    def __init__(self, message: str, position: int | None = None, text: str = "") -> None:
        self.message = message
        self.position = position
        if position is not None:
            line = text.count("\n", 0, position) + 1
            column = position - (text.rfind("\n", 0, position) + 1) + 1
            message = f"parse error at line {line}, column {column}: {message}"
        super().__init__(message)


class Sample(NamedTuple):
    """One element of an instant vector: its labels (``__name__`` included where the
    expression keeps it) and its value."""

    labels: dict[str, str]
    value: float


# --------------------------------------------------------------------------- the AST


@dataclass(frozen=True)
class NumberLiteral:
    value: float
    value_type: ClassVar[ValueType] = "scalar"


@dataclass(frozen=True)
class StringLiteral:
    value: str
    value_type: ClassVar[ValueType] = "string"


@dataclass(frozen=True)
class Matcher:
    """``label op "value"``; regexes are anchored at both ends, as in Prometheus."""

    label: str
    op: Literal["=", "!=", "=~", "!~"]
    value: str
    regex: re.Pattern[str] | None = field(default=None, compare=False, repr=False)

    def matches(self, value: str) -> bool:
        if self.op == "=":
            return value == self.value
        if self.op == "!=":
            return value != self.value
        assert self.regex is not None
        return (self.regex.fullmatch(value) is not None) == (self.op == "=~")


@dataclass(frozen=True)
class VectorSelector:
    name: str | None
    matchers: tuple[Matcher, ...]
    offset_ms: int = 0
    value_type: ClassVar[ValueType] = "vector"


@dataclass(frozen=True)
class MatrixSelector:
    selector: VectorSelector
    range_ms: int
    value_type: ClassVar[ValueType] = "matrix"


@dataclass(frozen=True)
class Call:
    function: str
    args: tuple[Expr, ...]

    @property
    def value_type(self) -> ValueType:
        return _FUNCTIONS[self.function][1]


@dataclass(frozen=True)
class Aggregate:
    op: str
    expr: Expr
    grouping: tuple[str, ...] = ()
    without: bool = False
    value_type: ClassVar[ValueType] = "vector"


@dataclass(frozen=True)
class VectorMatching:
    on: bool
    labels: tuple[str, ...]


@dataclass(frozen=True)
class Binary:
    op: str
    lhs: Expr
    rhs: Expr
    return_bool: bool = False
    matching: VectorMatching | None = None

    @property
    def value_type(self) -> ValueType:
        both_scalar = self.lhs.value_type == "scalar" and self.rhs.value_type == "scalar"
        return "scalar" if both_scalar else "vector"


@dataclass(frozen=True)
class Unary:
    op: str
    expr: Expr

    @property
    def value_type(self) -> ValueType:
        return self.expr.value_type


Expr = (
    NumberLiteral | StringLiteral | VectorSelector | MatrixSelector | Call | Aggregate | Binary
) | Unary

_COMPARISONS = frozenset({"==", "!=", ">", "<", ">=", "<="})
_SET_OPS = frozenset({"and", "or", "unless"})
_AGGREGATIONS = frozenset({"sum", "avg", "min", "max", "count"})
_UNSUPPORTED_AGGREGATIONS = frozenset(
    {"topk", "bottomk", "quantile", "count_values", "stddev", "stdvar", "group", "limitk"}
)
_KEYWORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "bool", "offset"}
    | {"group_left", "group_right"}
)

# ------------------------------------------------------------------------------ lexer

_TOKEN_RE = re.compile(
    r"""(?P<ws>\s+|\#[^\n]*)
    |(?P<number>0[xX][0-9a-fA-F]+|(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)
    |(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
    |(?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`[^`]*`)
    |(?P<op>==|!=|>=|<=|=~|!~|[-+*/%^=<>(){}\[\],:@])""",
    re.VERBOSE,
)
_ESCAPE_RE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[0-7]{3}|.)")
_SIMPLE_ESCAPES = {
    "a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
    "\\": "\\", "'": "'", '"': '"',
}  # fmt: skip
_DURATION_RE = re.compile(
    r"(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?"
)
_DURATION_UNITS_MS = (
    365 * 86_400_000, 7 * 86_400_000, 86_400_000, 3_600_000, 60_000, 1000, 1
)  # fmt: skip
_LABEL_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _Token(NamedTuple):
    kind: Literal["number", "ident", "string", "op", "eof"]
    text: str
    pos: int

    @property
    def end(self) -> int:
        return self.pos + len(self.text)

    def is_word(self, *words: str) -> bool:
        return self.kind == "ident" and self.text.lower() in words


def _tokenize(text: str) -> list[_Token]:
    tokens: list[_Token] = []
    pos = 0
    while pos < len(text):
        match = _TOKEN_RE.match(text, pos)
        if match is None:
            raise PromQLError(f"unexpected character {text[pos]!r}", pos, text)
        kind = match.lastgroup
        if kind != "ws":
            tokens.append(_Token(kind, match.group(), pos))  # type: ignore[arg-type]
        pos = match.end()
    tokens.append(_Token("eof", "", len(text)))
    return tokens


def _unquote(token: _Token, text: str) -> str:
    body = token.text[1:-1]
    if token.text[0] == "`":
        return body

    def escape(match: re.Match[str]) -> str:
        seq = match.group(1)
        if seq in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[seq]
        if seq[0] in "xuU" and len(seq) > 1:
            return chr(int(seq[1:], 16))
        if len(seq) == 3 and seq.isdigit():
            return chr(int(seq, 8))
        raise PromQLError(f"unknown escape sequence \\{seq}", token.pos, text)

    return _ESCAPE_RE.sub(escape, body)


def parse_duration_ms(text: str) -> int:
    """``5m``, ``1h30m``, ``500ms`` (units ``y w d h m s ms``, largest first) in ms."""
    match = _DURATION_RE.fullmatch(text)
    if not text or match is None:
        raise PromQLError(f"not a duration: {text!r}")
    return sum(
        int(n) * unit for n, unit in zip(match.groups(), _DURATION_UNITS_MS, strict=True) if n
    )


# ----------------------------------------------------------------------------- parser

_LEVELS: tuple[frozenset[str], ...] = (
    frozenset({"or"}),
    frozenset({"and", "unless"}),
    _COMPARISONS,
    frozenset({"+", "-"}),
    frozenset({"*", "/", "%"}),
)


class _Parser:
    """Recursive descent, one method per precedence level (``_LEVELS``, then unary,
    ``^``, postfix ranges/offsets, primaries)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokenize(text)
        self.i = 0

    def error(self, message: str, token: _Token | None = None) -> PromQLError:
        return PromQLError(message, (token or self.peek()).pos, self.text)

    def peek(self, ahead: int = 0) -> _Token:
        return self.tokens[min(self.i + ahead, len(self.tokens) - 1)]

    def next(self) -> _Token:
        token = self.peek()
        self.i += 1
        return token

    def expect(self, text: str) -> _Token:
        token = self.peek()
        if token.kind != "op" or token.text != text:
            raise self.error(f"expected {text!r}, found {_describe(token)}")
        return self.next()

    def at_op(self, *texts: str) -> bool:
        token = self.peek()
        return token.kind == "op" and token.text in texts

    def parse(self) -> Expr:
        expr = self.binary(0)
        if self.peek().kind != "eof":
            raise self.error(f"unexpected {_describe(self.peek())}")
        return expr

    def binary(self, level: int) -> Expr:
        if level == len(_LEVELS):
            return self.unary()
        lhs = self.binary(level + 1)
        while True:
            token = self.peek()
            op = token.text.lower() if token.kind == "ident" else token.text
            if token.kind not in ("op", "ident") or op not in _LEVELS[level]:
                return lhs
            self.next()
            return_bool, matching = self.modifiers(op)
            rhs = self.binary(level + 1)
            lhs = self.make_binary(op, lhs, rhs, return_bool, matching, token)

    def modifiers(self, op: str) -> tuple[bool, VectorMatching | None]:
        return_bool = False
        if self.peek().is_word("bool"):
            if op not in _COMPARISONS:
                raise self.error("bool modifier can only be used on comparison operators")
            self.next()
            return_bool = True
        matching = None
        if self.peek().is_word("on", "ignoring"):
            on = self.next().text.lower() == "on"
            matching = VectorMatching(on, self.label_list())
            if self.peek().is_word("group_left", "group_right"):
                raise self.error(f"{self.peek().text} (many-to-one matching) is not supported")
        return return_bool, matching

    def make_binary(
        self,
        op: str,
        lhs: Expr,
        rhs: Expr,
        return_bool: bool,
        matching: VectorMatching | None,
        token: _Token,
    ) -> Binary:
        types = (lhs.value_type, rhs.value_type)
        if any(t not in ("scalar", "vector") for t in types):
            raise self.error("binary expression must contain only scalar and vector types", token)
        if op in _SET_OPS and types != ("vector", "vector"):
            raise self.error(f"set operator {op!r} not allowed in binary scalar expression", token)
        if matching is not None and types != ("vector", "vector"):
            raise self.error("vector matching only allowed between instant vectors", token)
        if op in _COMPARISONS and types == ("scalar", "scalar") and not return_bool:
            raise self.error("comparisons between scalars must use BOOL modifier", token)
        return Binary(op, lhs, rhs, return_bool, matching)

    def unary(self) -> Expr:
        if not self.at_op("-", "+"):
            return self.power()
        token = self.next()
        return self.make_unary(token, self.unary())

    def make_unary(self, token: _Token, operand: Expr) -> Expr:
        if operand.value_type not in ("scalar", "vector"):
            raise self.error("unary expression only allowed on scalars and vectors", token)
        if token.text == "+":
            return operand
        if isinstance(operand, NumberLiteral):
            return NumberLiteral(-operand.value)
        return Unary("-", operand)

    def power(self) -> Expr:
        base = self.postfix()
        if not self.at_op("^"):
            return base
        token = self.next()
        return_bool, matching = self.modifiers("^")
        return self.make_binary("^", base, self.exponent(), return_bool, matching, token)

    def exponent(self) -> Expr:
        if self.at_op("-", "+"):
            token = self.next()
            return self.make_unary(token, self.exponent())
        return self.power()

    def postfix(self) -> Expr:
        parenthesised = self.at_op("(")
        expr = self.primary()
        if parenthesised and (self.at_op("[") or self.peek().is_word("offset")):
            raise self.error("ranges and offsets only follow a selector, not parentheses")
        if self.at_op("["):
            bracket = self.next()
            if not isinstance(expr, VectorSelector):
                raise self.error("ranges are only allowed on vector selectors", bracket)
            range_ms = self.duration()
            if range_ms <= 0:
                raise self.error("a range must be longer than zero", bracket)
            if self.at_op(":"):
                raise self.error("subqueries are not supported")
            self.expect("]")
            expr = MatrixSelector(expr, range_ms)
        if self.peek().is_word("offset"):
            expr = self.offset(expr)
        if self.at_op("@"):
            raise self.error("the @ modifier is not supported")
        return expr

    def offset(self, expr: Expr) -> Expr:
        token = self.next()
        sign = 1
        if self.at_op("-"):
            self.next()
            sign = -1
        offset_ms = sign * self.duration()
        if isinstance(expr, VectorSelector):
            return VectorSelector(expr.name, expr.matchers, offset_ms)
        if isinstance(expr, MatrixSelector):
            selector = expr.selector
            return MatrixSelector(
                VectorSelector(selector.name, selector.matchers, offset_ms), expr.range_ms
            )
        raise self.error("offset must follow a vector or range selector", token)

    def duration(self) -> int:
        """A duration lexes as a number followed by identifiers (``1h30m``: ``1``,
        ``h30m``); glue the adjacent tokens back together."""
        first = self.peek()
        if first.kind != "number":
            raise self.error(f"expected a duration, found {_describe(first)}")
        end = self.next().end
        while self.peek().kind in ("number", "ident") and self.peek().pos == end:
            end = self.next().end
        if ":" in self.text[first.pos : end]:
            raise self.error("subqueries are not supported", first)
        try:
            return parse_duration_ms(self.text[first.pos : end])
        except PromQLError as e:
            raise self.error(e.message, first) from None

    def primary(self) -> Expr:
        token = self.peek()
        if token.kind == "number":
            self.next()
            text = token.text
            return NumberLiteral(float(int(text, 16)) if text[:2] in ("0x", "0X") else float(text))
        if token.kind == "string":
            self.next()
            return StringLiteral(_unquote(token, self.text))
        if self.at_op("("):
            self.next()
            expr = self.binary(0)
            self.expect(")")
            return expr
        if self.at_op("{"):
            return self.selector(None)
        if token.kind == "ident":
            return self.identifier(token)
        raise self.error(f"unexpected {_describe(token)}")

    def identifier(self, token: _Token) -> Expr:
        word = token.text.lower()
        follows = self.peek(1)
        if word in ("inf", "nan"):
            self.next()
            return NumberLiteral(math.inf if word == "inf" else math.nan)
        if word in _AGGREGATIONS and (
            (follows.kind == "op" and follows.text == "(") or follows.is_word("by", "without")
        ):
            return self.aggregation()
        if word in _UNSUPPORTED_AGGREGATIONS:
            raise self.error(f"aggregation {word!r} is not supported")
        if follows.kind == "op" and follows.text == "(":
            return self.call()
        if word in _KEYWORDS:
            raise self.error(f"unexpected keyword {token.text!r}")
        self.next()
        return self.selector(token.text)

    def aggregation(self) -> Aggregate:
        op = self.next().text.lower()
        grouping: tuple[str, ...] | None = None
        without = False
        if self.peek().is_word("by", "without"):
            without = self.next().text.lower() == "without"
            grouping = self.label_list()
        self.expect("(")
        if self.at_op(")"):
            raise self.error(f"no arguments for aggregate expression {op!r}")
        expr = self.binary(0)
        if self.at_op(","):
            raise self.error(f"aggregation {op!r} takes one argument")
        self.expect(")")
        if self.peek().is_word("by", "without"):
            if grouping is not None:
                raise self.error("aggregation has two grouping clauses")
            without = self.next().text.lower() == "without"
            grouping = self.label_list()
        if expr.value_type != "vector":
            raise self.error(f"expected an instant vector in aggregation {op!r}")
        return Aggregate(op, expr, grouping or (), without)

    def label_list(self) -> tuple[str, ...]:
        self.expect("(")
        names: list[str] = []
        while not self.at_op(")"):
            token = self.next()
            if token.kind != "ident" or not _LABEL_NAME_RE.fullmatch(token.text):
                raise self.error(f"expected a label name, found {_describe(token)}", token)
            names.append(token.text)
            if not self.at_op(")"):
                self.expect(",")
        self.next()
        return tuple(names)

    def call(self) -> Call:
        token = self.next()
        name = token.text
        if name not in _FUNCTIONS:
            raise self.error(f"unknown or unsupported function {name!r}", token)
        self.expect("(")
        args: list[Expr] = []
        while not self.at_op(")"):
            args.append(self.binary(0))
            if not self.at_op(")"):
                self.expect(",")
        self.next()
        expected = _FUNCTIONS[name][0]
        if len(args) != len(expected):
            raise self.error(f"{name}() takes {len(expected)} argument(s), got {len(args)}", token)
        for arg, want in zip(args, expected, strict=True):
            if arg.value_type != want:
                got = _TYPE_NAMES[arg.value_type]
                raise self.error(f"{name}() expects {_TYPE_NAMES[want]} argument, got {got}")
        return Call(name, tuple(args))

    def selector(self, name: str | None) -> VectorSelector:
        start = self.peek()
        matchers: list[Matcher] = []
        if self.at_op("{"):
            self.next()
            while not self.at_op("}"):
                matchers.append(self.matcher())
                if not self.at_op("}"):
                    self.expect(",")
            self.next()
        for m in [m for m in matchers if m.label == "__name__" and m.op == "="]:
            if name is not None:
                raise self.error("metric name must not be set twice", start)
            name = m.value
            matchers.remove(m)
        if name is None and all(m.matches("") for m in matchers):
            raise self.error("vector selector must contain at least one non-empty matcher", start)
        return VectorSelector(name, tuple(matchers))

    def matcher(self) -> Matcher:
        label = self.next()
        if label.kind != "ident" or not _LABEL_NAME_RE.fullmatch(label.text):
            raise self.error(f"expected a label name, found {_describe(label)}", label)
        op = self.next()
        if op.kind != "op" or op.text not in ("=", "!=", "=~", "!~"):
            raise self.error(f"expected a label matching operator, found {_describe(op)}", op)
        value = self.next()
        if value.kind != "string":
            raise self.error(f"expected a string, found {_describe(value)}", value)
        text = _unquote(value, self.text)
        regex = None
        if op.text in ("=~", "!~"):
            try:
                regex = re.compile(f"(?s:{text})")
            except re.error as e:
                raise self.error(f"invalid regular expression {text!r}: {e}", value) from None
        return Matcher(label.text, op.text, text, regex)  # type: ignore[arg-type]


_TYPE_NAMES: dict[ValueType, str] = {
    "scalar": "a scalar",
    "vector": "an instant vector",
    "matrix": "a range vector",
    "string": "a string",
}


def _describe(token: _Token) -> str:
    return "end of input" if token.kind == "eof" else f"{token.text!r}"


def parse(text: str) -> Expr:
    """Parse a PromQL expression; :class:`PromQLError` (with the position) if it is
    malformed or uses what this module does not support."""
    return _Parser(text).parse()


def _selectors(expr: Expr) -> Iterator[tuple[VectorSelector, int]]:
    """Every selector in ``expr`` with how far back it reads from its offset (ms)."""
    stack: list[Expr] = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, MatrixSelector):
            yield node.selector, node.range_ms
        elif isinstance(node, VectorSelector):
            yield node, LOOKBACK_MS
        elif isinstance(node, Call):
            stack.extend(node.args)
        elif isinstance(node, Aggregate | Unary):
            stack.append(node.expr)
        elif isinstance(node, Binary):
            stack.extend((node.lhs, node.rhs))


def metric_names(expr: Expr) -> frozenset[str] | None:
    """The metric names ``expr`` reads, or ``None`` when a selector matches names by
    something other than equality (then any metric may be read). Suits
    ``SampleHistory(keep=...)``."""
    names = {selector.name for selector, _ in _selectors(expr)}
    return None if None in names else frozenset(n for n in names if n is not None)


def history_s(expr: Expr) -> float:
    """How many seconds before the evaluation time ``expr`` reads: what a
    :class:`SampleHistory` must retain for it."""
    reach = [reach_ms + selector.offset_ms for selector, reach_ms in _selectors(expr)]
    return max(reach, default=0) / 1000


# ---------------------------------------------------------------------------- storage


class _Series:
    """One series' retained samples: times (ms) and values in two arrays (16 bytes a
    sample), the times it went stale, and the time of its newest decrease (so that
    ``rate`` looks for counter resets only where there may be one)."""

    __slots__ = ("key", "labels", "last_drop_ms", "stale_ms", "times", "values")

    def __init__(self, key: tuple[str, ...], labels: dict[str, str]) -> None:
        self.key = key
        self.labels = labels
        self.times = array("q")
        self.values = array("d")
        self.stale_ms: list[int] = []
        self.last_drop_ms = -(2**62)

    def append(self, t_ms: int, value: float) -> None:
        if self.values and value < self.values[-1]:
            self.last_drop_ms = t_ms
        self.times.append(t_ms)
        self.values.append(value)

    def prune(self, cutoff_ms: int) -> bool:
        """Forget what is older than ``cutoff_ms``; whether anything is left."""
        times = self.times
        if times and times[0] < cutoff_ms:
            drop = bisect_right(times, cutoff_ms - 1)
            del times[:drop]
            del self.values[:drop]
        if self.stale_ms and self.stale_ms[0] < cutoff_ms:
            self.stale_ms = [t for t in self.stale_ms if t >= cutoff_ms]
        return bool(times)

    def stale_between(self, after_ms: int, until_ms: int) -> bool:
        """Whether the series went stale in ``(after_ms, until_ms]``."""
        stale = self.stale_ms
        i = bisect_right(stale, until_ms) - 1
        return i >= 0 and stale[i] > after_ms


class SampleHistory:
    """The scrapes the evaluator reads: ``add`` one scrape at a time, in time order.

    A series missing from a scrape is stale from that scrape on (Prometheus' staleness
    marker), until it appears again. Only ``retention_s`` of history is kept; with
    ``keep``, only those metric names are stored (see :func:`metric_names`)."""

    def __init__(self, retention_s: float, keep: Collection[str] | None = None) -> None:
        if retention_s <= 0:
            raise ValueError("retention_s must be positive")
        self.retention_ms = round(retention_s * 1000)
        self.keep = None if keep is None else frozenset(keep)
        self._series: dict[tuple[str, ...], _Series] = {}
        self._by_name: dict[str, list[_Series]] = {}
        self._unsorted: set[str] = set()
        self._live: dict[tuple[str, ...], _Series] = {}
        self._last_ms: int | None = None

    def __len__(self) -> int:
        return len(self._series)

    @property
    def last_scrape_s(self) -> float | None:
        """When the newest scrape was taken (seconds), ``None`` before the first."""
        return None if self._last_ms is None else self._last_ms / 1000

    def add(self, t: float, samples: Iterable[tuple[str, Mapping[str, str], float]]) -> None:
        """Record one scrape taken at ``t`` (seconds): ``(metric name, labels, value)``
        for every series it had."""
        t_ms = round(t * 1000)
        if self._last_ms is not None and t_ms <= self._last_ms:
            raise ValueError(f"scrape at {t} is not after the previous one")
        self._last_ms = t_ms
        seen: dict[tuple[str, ...], _Series] = {}
        for name, labels, value in samples:
            if self.keep is not None and name not in self.keep:
                continue
            key = (name, *sorted(f"{k}\x00{v}" for k, v in labels.items() if k != "__name__"))
            series = seen.get(key)
            if series is not None:  # the same series twice in a scrape: the last one counts
                series.values[-1] = float(value)
                continue
            series = self._series.get(key) or self._new_series(key, name, labels)
            series.append(t_ms, float(value))
            seen[key] = series
        for key, series in self._live.items():
            if key not in seen:
                series.stale_ms.append(t_ms)
        self._live = seen
        self._prune(t_ms - self.retention_ms)

    def _new_series(self, key: tuple[str, ...], name: str, labels: Mapping[str, str]) -> _Series:
        others = {k: str(v) for k, v in labels.items() if k != "__name__"}
        series = _Series(key, {"__name__": name, **others})
        self._series[key] = series
        self._by_name.setdefault(name, []).append(series)
        self._unsorted.add(name)
        return series

    def _prune(self, cutoff_ms: int) -> None:
        gone = [key for key, s in self._series.items() if not s.prune(cutoff_ms)]
        for key in gone:
            series = self._series.pop(key)
            self._by_name[key[0]].remove(series)
            if not self._by_name[key[0]]:
                del self._by_name[key[0]]

    def select(self, selector: VectorSelector) -> Iterator[_Series]:
        """The series ``selector`` matches, sorted by labels (as Prometheus' storage
        returns them, which fixes the order of sums)."""
        if selector.name is None:
            names: Iterable[str] = sorted(self._by_name)
        else:
            names = (selector.name,)
        matchers = selector.matchers
        for name in names:
            candidates = self._by_name.get(name, ())
            if name in self._unsorted:
                self._by_name[name].sort(key=lambda s: s.key)
                self._unsorted.discard(name)
            for series in candidates:
                labels = series.labels
                if all(m.matches(labels.get(m.label, "")) for m in matchers):
                    yield series


# -------------------------------------------------------------------------- evaluator

Value = float | list[Sample]


def evaluate(expr: str | Expr, history: SampleHistory, t: float) -> list[Sample] | float:
    """Evaluate ``expr`` at ``t`` (seconds) over ``history``: an instant vector (a new
    list of new label dicts) or a scalar. :class:`PromQLError` for a range vector or a
    string, and for what Prometheus refuses at evaluation (many-to-many matching)."""
    node = parse(expr) if isinstance(expr, str) else expr
    if node.value_type not in ("scalar", "vector"):
        raise PromQLError(f"{_TYPE_NAMES[node.value_type]} cannot be evaluated at an instant")
    result = _Evaluator(history, round(t * 1000)).eval(node)
    if isinstance(result, float):
        return result
    return [Sample(dict(s.labels), s.value) for s in result]


class _Window(NamedTuple):
    """The samples ``series.times[lo:hi]`` of a range selector's ``(start, end]``."""

    series: _Series
    lo: int
    hi: int
    start_ms: int
    end_ms: int
    range_ms: int


class _Evaluator:
    def __init__(self, history: SampleHistory, t_ms: int) -> None:
        self.history = history
        self.t_ms = t_ms

    def eval(self, node: Expr) -> Value:
        if isinstance(node, NumberLiteral):
            return node.value
        if isinstance(node, VectorSelector):
            return self.instant(node)
        if isinstance(node, Call):
            return self.call(node)
        if isinstance(node, Aggregate):
            return _aggregate(node, self.vector(node.expr))
        if isinstance(node, Binary):
            return self.binary(node)
        if isinstance(node, Unary):
            operand = self.eval(node.expr)
            if isinstance(operand, float):
                return -operand
            return _drop_names([Sample(s.labels, -s.value) for s in operand])
        raise PromQLError(f"cannot evaluate a {node.value_type} here")

    def vector(self, node: Expr) -> list[Sample]:
        value = self.eval(node)
        assert isinstance(value, list)
        return value

    def scalar(self, node: Expr) -> float:
        value = self.eval(node)
        assert isinstance(value, float)
        return value

    def instant(self, selector: VectorSelector) -> list[Sample]:
        t_ms = self.t_ms - selector.offset_ms
        oldest = t_ms - LOOKBACK_MS
        out = []
        for series in self.history.select(selector):
            times = series.times
            i = len(times) - 1 if times[-1] <= t_ms else bisect_right(times, t_ms) - 1
            if i < 0 or times[i] <= oldest:
                continue
            if series.stale_ms and series.stale_between(times[i], t_ms):
                continue
            out.append(Sample(series.labels, series.values[i]))
        return out

    def windows(self, matrix: MatrixSelector) -> Iterator[_Window]:
        end = self.t_ms - matrix.selector.offset_ms
        start = end - matrix.range_ms
        for series in self.history.select(matrix.selector):
            times = series.times
            lo = bisect_right(times, start)
            hi = len(times) if times[-1] <= end else bisect_right(times, end, lo)
            if hi > lo:
                yield _Window(series, lo, hi, start, end, matrix.range_ms)

    def call(self, node: Call) -> Value:
        name = node.function
        if name in _RANGE_FUNCTIONS:
            assert isinstance(node.args[0], MatrixSelector)
            function = _RANGE_FUNCTIONS[name]
            out = []
            for window in self.windows(node.args[0]):
                value = function(window)
                if value is not None:
                    out.append(Sample(window.series.labels, value))
            return _drop_names(out)
        if name == "time":
            return self.t_ms / 1000
        if name == "vector":
            return [Sample({}, self.scalar(node.args[0]))]
        if name == "scalar":
            vector = self.vector(node.args[0])
            return vector[0].value if len(vector) == 1 else math.nan
        if name == "histogram_quantile":
            return _histogram_quantile(self.scalar(node.args[0]), self.vector(node.args[1]))
        vector = self.vector(node.args[0])
        bounds = [self.scalar(arg) for arg in node.args[1:]]
        return _drop_names(_INSTANT_FUNCTIONS[name](vector, *bounds))

    def binary(self, node: Binary) -> Value:
        lhs, rhs = self.eval(node.lhs), self.eval(node.rhs)
        op = node.op
        if isinstance(lhs, float) and isinstance(rhs, float):
            if op in _COMPARISONS:
                return 1.0 if _compare(op, lhs, rhs) else 0.0
            return _arith(op, lhs, rhs)
        if isinstance(lhs, list) and isinstance(rhs, list):
            if op in _SET_OPS:
                return _set_operation(op, lhs, rhs, node.matching)
            return _vector_binop(node, lhs, rhs)
        if isinstance(lhs, list):
            assert isinstance(rhs, float)
            return _vector_scalar(node, lhs, rhs, swap=False)
        assert isinstance(rhs, list)
        return _vector_scalar(node, rhs, lhs, swap=True)


# ------------------------------------------------------------- arithmetic, Go's way


def _div(a: float, b: float) -> float:
    if b != 0:
        return a / b
    if a == 0 or math.isnan(a):
        return math.nan
    return math.copysign(math.inf, a) * math.copysign(1.0, b)


def _mod(a: float, b: float) -> float:
    try:
        return math.fmod(a, b)
    except ValueError:  # Go's math.Mod answers NaN for x % 0 and Inf % y
        return math.nan


def _is_odd_integer(x: float) -> bool:
    return math.isfinite(x) and x == int(x) and int(x) % 2 == 1


def _pow(a: float, b: float) -> float:
    try:
        return math.pow(a, b)
    except OverflowError:
        return -math.inf if a < 0 and _is_odd_integer(b) else math.inf
    except ValueError:
        if a == 0:  # 0 ** negative: Go answers ±Inf
            return math.copysign(math.inf, a) if _is_odd_integer(b) else math.inf
        return math.nan


_ARITHMETIC: dict[str, Callable[[float, float], float]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": _div,
    "%": _mod,
    "^": _pow,
}
_COMPARE: dict[str, Callable[[float, float], bool]] = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
}


def _arith(op: str, a: float, b: float) -> float:
    return _ARITHMETIC[op](a, b)


def _compare(op: str, a: float, b: float) -> bool:
    return _COMPARE[op](a, b)


def _without_name(labels: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in labels.items() if k != "__name__"}


def _labels_text(labels: Mapping[str, str]) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def _drop_names(vector: list[Sample]) -> list[Sample]:
    """The vector without metric names; an error if that makes two elements alike
    (``vector cannot contain metrics with the same labelset``)."""
    names = {s.labels.get("__name__") for s in vector}
    out = [Sample(_without_name(s.labels), s.value) for s in vector]
    if len(names) > 1:
        seen: set[tuple[tuple[str, str], ...]] = set()
        for sample in out:
            key = tuple(sorted(sample.labels.items()))
            if key in seen:
                raise PromQLError("vector cannot contain metrics with the same labelset")
            seen.add(key)
    return out


def _vector_scalar(node: Binary, vector: list[Sample], scalar: float, swap: bool) -> list[Sample]:
    op = node.op
    out = []
    if op in _COMPARISONS:
        compare = _COMPARE[op]
        for s in vector:
            keep = compare(scalar, s.value) if swap else compare(s.value, scalar)
            if node.return_bool:
                out.append(Sample(_without_name(s.labels), 1.0 if keep else 0.0))
            elif keep:
                out.append(s)
        return out
    arith = _ARITHMETIC[op]
    for s in vector:
        value = arith(scalar, s.value) if swap else arith(s.value, scalar)
        out.append(Sample(_without_name(s.labels), value))
    return out


def _signature(matching: VectorMatching | None) -> Callable[[dict[str, str]], tuple[str, ...]]:
    """How two elements are matched: on the ``on`` labels, or on all labels but the
    ``ignoring`` ones and the metric name."""
    if matching is not None and matching.on:
        names = sorted(matching.labels)
        return lambda labels: tuple(labels.get(n, "") for n in names)
    ignored = {"__name__", *(matching.labels if matching else ())}
    return lambda labels: tuple(
        sorted(f"{k}\x00{v}" for k, v in labels.items() if k not in ignored)
    )


def _vector_binop(node: Binary, lhs: list[Sample], rhs: list[Sample]) -> list[Sample]:
    """One-to-one matching (``VectorBinop`` of ``promql/engine.go``)."""
    if not lhs or not rhs:
        return []
    signature = _signature(node.matching)
    right: dict[tuple[str, ...], Sample] = {}
    for sample in rhs:
        sig = signature(sample.labels)
        if sig in right:
            raise PromQLError(
                "found duplicate series for the match group on the right hand-side of the "
                f"operation: [{_labels_text(sample.labels)}, "
                f"{_labels_text(right[sig].labels)}];many-to-many matching not allowed: "
                "matching labels must be unique on one side"
            )
        right[sig] = sample
    op, matching = node.op, node.matching
    comparison = op in _COMPARISONS
    matched: set[tuple[str, ...]] = set()
    out = []
    for sample in lhs:
        sig = signature(sample.labels)
        other = right.get(sig)
        if other is None:
            continue
        if comparison:
            keep = _COMPARE[op](sample.value, other.value)
            value = (1.0 if keep else 0.0) if node.return_bool else sample.value
            if not (keep or node.return_bool):
                continue
        else:
            value = _ARITHMETIC[op](sample.value, other.value)
        if sig in matched:
            raise PromQLError(
                "multiple matches for labels: many-to-one matching must be explicit "
                "(group_left/group_right)"
            )
        matched.add(sig)
        out.append(Sample(_result_labels(sample.labels, node, matching), value))
    return out


def _result_labels(
    labels: dict[str, str], node: Binary, matching: VectorMatching | None
) -> dict[str, str]:
    if matching is not None and matching.on:
        return {k: v for k, v in labels.items() if k in matching.labels}
    drop = set(matching.labels) if matching else set()
    if node.return_bool or node.op not in _COMPARISONS:
        drop.add("__name__")
    return {k: v for k, v in labels.items() if k not in drop} if drop else labels


def _set_operation(
    op: str, lhs: list[Sample], rhs: list[Sample], matching: VectorMatching | None
) -> list[Sample]:
    signature = _signature(matching)
    if op == "or":
        left = {signature(s.labels) for s in lhs}
        return lhs + [s for s in rhs if signature(s.labels) not in left]
    if op == "and" and not (lhs and rhs):
        return []
    right = {signature(s.labels) for s in rhs}
    if op == "and":
        return [s for s in lhs if signature(s.labels) in right]
    return [s for s in lhs if signature(s.labels) not in right]


# ------------------------------------------------------------------------ aggregation


def _kahan_inc(inc: float, total: float, c: float) -> tuple[float, float]:
    """One step of Kahan-Neumaier summation (``kahanSumInc``)."""
    t = total + inc
    if math.isinf(t):
        c = 0.0
    elif abs(total) >= abs(inc):
        c += (total - t) + inc
    else:
        c += (inc - t) + total
    return t, c


class _Mean:
    """Prometheus' mean: a Kahan sum divided at the end, or an incremental mean once
    the sum would overflow."""

    __slots__ = ("c", "count", "incremental", "mean", "total")

    def __init__(self, first: float) -> None:
        self.total, self.mean, self.c, self.count = first, first, 0.0, 1.0
        self.incremental = False

    def add(self, value: float) -> None:
        self.count += 1
        if not self.incremental:
            total, c = _kahan_inc(value, self.total, self.c)
            if not math.isinf(total):
                self.total, self.c = total, c
                return
            self.incremental = True
            self.mean = self.total / (self.count - 1)
            self.c /= self.count - 1
        q = (self.count - 1) / self.count
        self.mean, self.c = _kahan_inc(value / self.count, q * self.mean, q * self.c)

    def result(self) -> float:
        if self.incremental:
            return self.mean + self.c
        return self.total / self.count + self.c / self.count


def _aggregate(node: Aggregate, vector: list[Sample]) -> list[Sample]:
    grouping = node.grouping
    if node.without:
        dropped = {"__name__", *grouping}

        def group_labels(labels: dict[str, str]) -> dict[str, str]:
            return {k: v for k, v in labels.items() if k not in dropped}

    else:

        def group_labels(labels: dict[str, str]) -> dict[str, str]:
            return {k: labels[k] for k in grouping if labels.get(k)}

    groups: dict[tuple[str, ...], tuple[dict[str, str], list[float]]] = {}
    for sample in vector:
        labels = group_labels(sample.labels)
        key = tuple(sorted(f"{k}\x00{v}" for k, v in labels.items()))
        if key in groups:
            groups[key][1].append(sample.value)
        else:
            groups[key] = (labels, [sample.value])
    reduce = _REDUCERS[node.op]
    return [Sample(labels, reduce(values)) for labels, values in groups.values()]


def _sum(values: list[float]) -> float:
    total, c = values[0], 0.0
    for value in values[1:]:
        total, c = _kahan_inc(value, total, c)
    return total + c


def _avg(values: list[float]) -> float:
    mean = _Mean(values[0])
    for value in values[1:]:
        mean.add(value)
    return mean.result()


def _min(values: list[float]) -> float:
    result = values[0]
    for value in values[1:]:
        if result > value or math.isnan(result):
            result = value
    return result


def _max(values: list[float]) -> float:
    result = values[0]
    for value in values[1:]:
        if result < value or math.isnan(result):
            result = value
    return result


_REDUCERS: dict[str, Callable[[list[float]], float]] = {
    "sum": _sum,
    "avg": _avg,
    "min": _min,
    "max": _max,
    "count": lambda values: float(len(values)),
}


# -------------------------------------------------------------------------- functions


def _range_seconds(range_ms: int) -> float:
    """Go's ``Duration.Seconds()``: whole seconds plus the nanoseconds / 1e9."""
    return range_ms // 1000 + (range_ms % 1000) * 1_000_000 / 1e9


def _extrapolated_rate(w: _Window, is_counter: bool, is_rate: bool) -> float | None:
    """``rate``/``increase``/``delta`` as ``extrapolatedRate`` (Prometheus 3): the
    change over the window, counter resets added back, extrapolated to the window's
    edges when the first/last sample lies within 1.1 average intervals of them (else
    by half an interval), a counter never extrapolated below zero."""
    times, values, lo, hi = w.series.times, w.series.values, w.lo, w.hi
    if hi - lo < 2:
        return None
    first_t, last_t, first_v = times[lo], times[hi - 1], values[lo]
    result = values[hi - 1] - first_v
    if is_counter and w.series.last_drop_ms > first_t:
        previous = first_v
        for i in range(lo + 1, hi):
            value = values[i]
            if value < previous:
                result += previous
            previous = value
    to_start = (first_t - w.start_ms) / 1000
    to_end = (w.end_ms - last_t) / 1000
    sampled = (last_t - first_t) / 1000
    average = sampled / (hi - lo - 1)
    threshold = average * 1.1
    if to_start >= threshold:
        to_start = average / 2
    if is_counter and result > 0 and first_v >= 0:
        to_zero = sampled * (first_v / result)
        if to_zero < to_start:
            to_start = to_zero
    interval = sampled + to_start
    if to_end >= threshold:
        to_end = average / 2
    interval += to_end
    factor = interval / sampled
    if is_rate:
        factor /= _range_seconds(w.range_ms)
    return result * factor


def _instant_rate(w: _Window, is_rate: bool) -> float | None:
    """``irate``/``idelta``: from the last two samples of the window."""
    if w.hi - w.lo < 2:
        return None
    times, values = w.series.times, w.series.values
    previous, last = values[w.hi - 2], values[w.hi - 1]
    interval_ms = times[w.hi - 1] - times[w.hi - 2]
    result = last if is_rate and last < previous else last - previous
    return result / (interval_ms / 1000) if is_rate else result


def _over_time(reduce: Callable[[list[float]], float]) -> Callable[[_Window], float]:
    return lambda w: reduce(w.series.values[w.lo : w.hi].tolist())


_RANGE_FUNCTIONS: dict[str, Callable[[_Window], float | None]] = {
    "rate": lambda w: _extrapolated_rate(w, is_counter=True, is_rate=True),
    "increase": lambda w: _extrapolated_rate(w, is_counter=True, is_rate=False),
    "delta": lambda w: _extrapolated_rate(w, is_counter=False, is_rate=False),
    "irate": lambda w: _instant_rate(w, is_rate=True),
    "idelta": lambda w: _instant_rate(w, is_rate=False),
    "avg_over_time": _over_time(_avg),
    "sum_over_time": lambda w: _sum_over_time(w.series.values[w.lo : w.hi].tolist()),
    "min_over_time": _over_time(_min),
    "max_over_time": _over_time(_max),
    "count_over_time": lambda w: float(w.hi - w.lo),
}


def _sum_over_time(values: list[float]) -> float:
    total, c = 0.0, 0.0
    for value in values:
        total, c = _kahan_inc(value, total, c)
    return total if math.isinf(total) else total + c


def _go_max(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _go_min(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else min(a, b)


def _map(vector: list[Sample], fn: Callable[[float], float]) -> list[Sample]:
    return [Sample(s.labels, fn(s.value)) for s in vector]


def _clamp(vector: list[Sample], low: float, high: float) -> list[Sample]:
    if high < low:
        return []
    return _map(vector, lambda v: _go_max(low, _go_min(high, v)))


_INSTANT_FUNCTIONS: dict[str, Callable[..., list[Sample]]] = {
    "abs": lambda vector: _map(vector, abs),
    "ceil": lambda vector: _map(vector, lambda v: float(math.ceil(v)) if math.isfinite(v) else v),
    "floor": lambda vector: _map(vector, lambda v: float(math.floor(v)) if math.isfinite(v) else v),
    "clamp": _clamp,
    "clamp_min": lambda vector, low: _map(vector, lambda v: _go_max(low, v)),
    "clamp_max": lambda vector, high: _map(vector, lambda v: _go_min(high, v)),
}

_FUNCTIONS: dict[str, tuple[tuple[ValueType, ...], ValueType]] = {
    **{name: (("matrix",), "vector") for name in _RANGE_FUNCTIONS},
    **{name: (("vector",), "vector") for name in ("abs", "ceil", "floor")},
    "clamp": (("vector", "scalar", "scalar"), "vector"),
    "clamp_min": (("vector", "scalar"), "vector"),
    "clamp_max": (("vector", "scalar"), "vector"),
    "histogram_quantile": (("scalar", "vector"), "vector"),
    "scalar": (("vector",), "scalar"),
    "vector": (("scalar",), "vector"),
    "time": ((), "scalar"),
}
"""Each supported function: its argument types and its result type."""


def _histogram_quantile(q: float, vector: list[Sample]) -> list[Sample]:
    """Classic-histogram quantiles: the ``le`` buckets of each label set (``le`` aside)."""
    groups: dict[tuple[str, ...], tuple[dict[str, str], list[tuple[float, float]]]] = {}
    for sample in vector:
        try:
            upper = float(sample.labels.get("le", ""))
        except ValueError:
            continue
        labels = {k: v for k, v in sample.labels.items() if k != "le"}
        key = tuple(sorted(f"{k}\x00{v}" for k, v in labels.items()))
        if key not in groups:
            groups[key] = (_without_name(labels), [])
        groups[key][1].append((upper, sample.value))
    return [Sample(labels, _bucket_quantile(q, buckets)) for labels, buckets in groups.values()]


def _bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """``BucketQuantile`` of ``promql/quantile.go``: sort by upper bound, require a
    ``+Inf`` bucket, merge equal bounds, force monotonic counts, then interpolate
    linearly inside the bucket the rank falls in (the lowest from 0 when its bound is
    positive; the ``+Inf`` one answers the bound below it)."""
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    buckets = sorted(buckets, key=lambda b: b[0])
    if not math.isinf(buckets[-1][0]) or buckets[-1][0] < 0:
        return math.nan
    bounds, counts = _coalesce(buckets)
    _ensure_monotonic(counts)
    if len(bounds) < 2 or counts[-1] == 0:
        return math.nan
    rank = q * counts[-1]
    b = next((i for i in range(len(bounds) - 1) if counts[i] >= rank), len(bounds) - 1)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, end, count = 0.0, bounds[b], counts[b]
    if b > 0:
        start = bounds[b - 1]
        count -= counts[b - 1]
        rank -= counts[b - 1]
    return start + (end - start) * (rank / count)


def _coalesce(buckets: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    bounds: list[float] = []
    counts: list[float] = []
    for upper, count in buckets:
        if bounds and bounds[-1] == upper:
            counts[-1] += count
        else:
            bounds.append(upper)
            counts.append(count)
    return bounds, counts


def _almost_equal(a: float, b: float, epsilon: float) -> bool:
    """``util/almost.Equal`` (relative tolerance; NaNs equal)."""
    if math.isnan(a) and math.isnan(b):
        return True
    if a == b:
        return True
    abs_sum, diff = abs(a) + abs(b), abs(a - b)
    min_normal = 2.2250738585072014e-308
    if a == 0 or b == 0 or abs_sum < min_normal:
        return diff < epsilon * min_normal
    return diff / min(abs_sum, 1.7976931348623157e308) < epsilon


def _ensure_monotonic(counts: list[float]) -> None:
    """``ensureMonotonicAndIgnoreSmallDeltas``: a count below the one before it (or
    within 1e-12 of it, a float artefact) takes the previous count."""
    previous = counts[0]
    for i in range(1, len(counts)):
        current = counts[i]
        if current == previous:
            continue
        if _almost_equal(previous, current, 1e-12) or current < previous:
            counts[i] = previous
            continue
        previous = current
