"""The shipped alerts, computed in the server: Prometheus' rule evaluation without a
Prometheus.

The console answers "which alerts are firing" from the same rules file operators load
into Prometheus (``alerts.yml``, a byte-identical copy of
``deploy/prometheus/alerts.yml``), evaluated by :mod:`inferd.monitoring.promql` over
the server's own scrapes. What it keeps from Prometheus (``rules/alerting.go``):

- Each result series is an alert whose labels are the series' labels without
  ``__name__``, then the rule's labels, then ``alertname``.
- A new alert is *pending*; it turns *firing* once it has been active for the rule's
  ``for`` (at the first evaluation at or after that; at once without ``for``); it is
  resolved, and forgotten, at the first evaluation whose result lacks it. When a rule
  fails to evaluate, its alerts stay as they were and the error is kept in ``errors``.
- Annotations (and label values) are rendered at every evaluation, for the template
  subset the rules use: ``{{ $labels.NAME }}``, ``{{ $value }}`` and ``{{ $value | f }}``
  (or ``{{ f $value }}``) with ``f`` one of ``humanize``, ``humanizeDuration``,
  ``humanizePercentage``, formatted as Go and Prometheus format them. Any other
  template, and recording rules or ``keep_firing_for``, are refused when the file is
  loaded (:class:`RuleError`), not rendered differently.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from inferd.monitoring.promql import (
    Expr,
    PromQLError,
    Sample,
    SampleHistory,
    evaluate,
    history_s,
    metric_names,
    parse,
    parse_duration_ms,
)

logger = logging.getLogger(__name__)

SHIPPED_RULES = "alerts.yml"
"""The package's copy of ``deploy/prometheus/alerts.yml``."""


class RuleError(ValueError):
    """A rules file this module cannot evaluate faithfully (malformed, or using what
    it does not support)."""


# --------------------------------------------------------------- Go's number formats


def _go_g(value: float, precision: int) -> str:
    """Go's ``%.<precision>g`` (Python's, but with Go's spelling of NaN and infinities)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return f"{value:.{precision}g}"


def go_float(value: float) -> str:
    """A float as Go's ``fmt.Sprint`` writes it (how ``{{ $value }}`` renders): the
    shortest digits that read back exactly, in exponent form below 1e-4 or from 1e6."""
    if math.isnan(value) or math.isinf(value):
        return _go_g(value, 4)
    if value == 0:
        return "-0" if math.copysign(1.0, value) < 0 else "0"
    sign, digit_tuple, exponent = Decimal(repr(value)).as_tuple()
    assert isinstance(exponent, int)
    digits = "".join(map(str, digit_tuple))
    point = len(digits) + exponent  # the decimal point sits after this many digits
    digits = digits.rstrip("0")
    minus = "-" if sign else ""
    exp10 = point - 1
    if exp10 < -4 or exp10 >= 6:
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{minus}{mantissa}e{'-' if exp10 < 0 else '+'}{abs(exp10):02d}"
    if point <= 0:
        return f"{minus}0.{'0' * -point}{digits}"
    if point >= len(digits):
        return f"{minus}{digits}{'0' * (point - len(digits))}"
    return f"{minus}{digits[:point]}.{digits[point:]}"


def _go_int64(value: float) -> int:
    """Go's float64 → int64 conversion on amd64: truncation, out of range → MinInt64."""
    return int(value) if -(2**63) <= value < 2**63 else -(2**63)


def _go_quo(a: int, b: int) -> int:
    """Go's integer division (truncates toward zero)."""
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def humanize(value: float) -> str:
    """Prometheus' ``humanize``: SI prefixes, 4 significant digits."""
    if value == 0 or math.isnan(value) or math.isinf(value):
        return _go_g(value, 4)
    prefix = ""
    if abs(value) >= 1:
        for p in ("k", "M", "G", "T", "P", "E", "Z", "Y"):
            if abs(value) < 1000:
                break
            prefix, value = p, value / 1000
        return f"{_go_g(value, 4)}{prefix}"
    return _humanize_small(value, "")


def _humanize_small(value: float, unit: str) -> str:
    prefix = ""
    for p in ("m", "u", "n", "p", "f", "a", "z", "y"):
        if abs(value) >= 1:
            break
        prefix, value = p, value * 1000
    return f"{_go_g(value, 4)}{prefix}{unit}"


def humanize_duration(value: float) -> str:
    """Prometheus' ``humanizeDuration``: ``1d 2h 3m 4s`` from a minute up, ``1.5s``,
    ``250ms``, ``12.34us`` below."""
    if math.isnan(value) or math.isinf(value):
        return _go_g(value, 4)
    if value == 0:
        return _go_g(value, 4) + "s"
    if abs(value) < 1:
        return _humanize_small(value, "s")
    sign = "-" if value < 0 else ""
    value = abs(value)
    seconds_total = _go_int64(value)
    minutes_total = _go_quo(seconds_total, 60)
    hours_total = _go_quo(minutes_total, 60)
    days = _go_quo(hours_total, 24)
    seconds = seconds_total - minutes_total * 60
    minutes = minutes_total - hours_total * 60
    hours = hours_total - days * 24
    if days != 0:
        return f"{sign}{days}d {hours}h {minutes}m {seconds}s"
    if hours != 0:
        return f"{sign}{hours}h {minutes}m {seconds}s"
    if minutes != 0:
        return f"{sign}{minutes}m {seconds}s"
    return f"{sign}{_go_g(value, 4)}s"


def humanize_percentage(value: float) -> str:
    """Prometheus' ``humanizePercentage``: a ratio as a percentage, 4 digits."""
    return _go_g(value * 100, 4) + "%"


_FORMATTERS: dict[str, Callable[[float], str]] = {
    "humanize": humanize,
    "humanizeDuration": humanize_duration,
    "humanizePercentage": humanize_percentage,
}

# ------------------------------------------------------------------------- templates

_ACTION_RE = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
_OPERAND_RE = re.compile(r"(?:\$labels|\.Labels)\.([A-Za-z_][A-Za-z0-9_]*)|(\$value|\.Value)")


@dataclass(frozen=True)
class _Action:
    label: str | None  # None: the value
    formatter: str | None


class _Template:
    """A rule's label or annotation template, compiled once; see the module docstring
    for the subset."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.parts: list[str | _Action] = []
        end = 0
        for match in _ACTION_RE.finditer(text):
            self._literal(text[end : match.start()])
            self.parts.append(_action(match.group(1)))
            end = match.end()
        self._literal(text[end:])

    def _literal(self, text: str) -> None:
        if "{{" in text or "}}" in text:
            raise RuleError(f"unbalanced template braces in {self.text!r}")
        if text:
            self.parts.append(text)

    def render(self, labels: Mapping[str, str], value: float) -> str:
        out = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
            elif part.label is not None:
                out.append(labels.get(part.label, ""))
            elif part.formatter is not None:
                out.append(_FORMATTERS[part.formatter](value))
            else:
                out.append(go_float(value))
        return "".join(out)


def _action(source: str) -> _Action:
    body = source.strip()
    formatter: str | None = None
    if "|" in body:
        body, formatter = (p.strip() for p in body.split("|", 1))
    elif len(words := body.split()) == 2:
        formatter, body = words
    match = _OPERAND_RE.fullmatch(body)
    if match is None or (formatter is not None and formatter not in _FORMATTERS):
        raise RuleError(
            f"template action {{{{{source}}}}} is not supported: use $labels.NAME or "
            f"$value, optionally through {', '.join(sorted(_FORMATTERS))}"
        )
    if match.group(1) is not None and formatter is not None:
        raise RuleError(f"template action {{{{{source}}}}}: formatters apply to $value")
    return _Action(match.group(1), formatter)


# ----------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class AlertRule:
    """One ``alert:`` rule, its expression parsed and its templates compiled."""

    name: str
    expr_text: str
    expr: Expr = field(repr=False)
    for_s: float
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    group: str = ""
    _label_templates: dict[str, _Template] = field(init=False, repr=False, compare=False)
    _annotation_templates: dict[str, _Template] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Compile the templates (:class:`RuleError` for an unsupported one)."""
        labels = {k: _Template(v) for k, v in self.labels.items()}
        annotations = {k: _Template(v) for k, v in self.annotations.items()}
        object.__setattr__(self, "_label_templates", labels)
        object.__setattr__(self, "_annotation_templates", annotations)

    def alert_labels(self, sample: Sample) -> dict[str, str]:
        labels = {k: v for k, v in sample.labels.items() if k != "__name__"}
        for name, template in self._label_templates.items():
            labels[name] = template.render(sample.labels, sample.value)
        labels["alertname"] = self.name
        return labels

    def render_annotations(self, sample: Sample) -> dict[str, str]:
        return {
            name: template.render(sample.labels, sample.value)
            for name, template in self._annotation_templates.items()
        }


_RULE_KEYS = frozenset({"alert", "expr", "for", "labels", "annotations"})
_GROUP_KEYS = frozenset({"name", "rules", "interval"})


@dataclass(frozen=True)
class AlertRules:
    """The alerting rules of one Prometheus rules file."""

    rules: tuple[AlertRule, ...]

    @classmethod
    def parse(cls, text: str, source: str = "<rules>") -> AlertRules:
        """Rules from the YAML text of a Prometheus rules file; :class:`RuleError`
        (naming ``source`` and the rule) for anything malformed or unsupported."""
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise RuleError(f"{source}: not YAML: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("groups"), list):
            raise RuleError(f"{source}: expected a mapping with a 'groups' list")
        rules: list[AlertRule] = []
        for group in data["groups"]:
            if not isinstance(group, dict) or not isinstance(group.get("rules"), list):
                raise RuleError(f"{source}: each group needs a 'rules' list")
            _no_other_keys(group, _GROUP_KEYS, f"{source}: group {group.get('name')!r}")
            name = str(group.get("name", ""))
            rules.extend(_parse_rule(rule, name, source) for rule in group["rules"])
        return cls(tuple(rules))

    @classmethod
    def load(cls, path: str | Path) -> AlertRules:
        return cls.parse(Path(path).read_text(encoding="utf-8"), str(path))

    @classmethod
    def shipped(cls) -> AlertRules:
        """The rules inferd ships (the package's ``alerts.yml``)."""
        text = resources.files("inferd.monitoring").joinpath(SHIPPED_RULES).read_text("utf-8")
        return cls.parse(text, SHIPPED_RULES)

    def __iter__(self) -> Iterator[AlertRule]:
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def metric_names(self) -> frozenset[str] | None:
        """The metric names the rules read (``None``: any), for ``SampleHistory(keep=)``."""
        names: set[str] = set()
        for rule in self.rules:
            read = metric_names(rule.expr)
            if read is None:
                return None
            names |= read
        return frozenset(names)

    def history_s(self) -> float:
        """The seconds of history the rules read, for ``SampleHistory(retention_s=)``."""
        return max((history_s(rule.expr) for rule in self.rules), default=0.0)


def _no_other_keys(mapping: dict[Any, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(str(k) for k in mapping if k not in allowed)
    if unknown:
        raise RuleError(f"{where}: unsupported field(s) {', '.join(unknown)}")


def _parse_rule(rule: Any, group: str, source: str) -> AlertRule:
    where = f"{source}: group {group!r}"
    if isinstance(rule, dict) and "record" in rule:
        raise RuleError(f"{where}: recording rules are not supported")
    if not isinstance(rule, dict) or not isinstance(rule.get("alert"), str):
        raise RuleError(f"{where}: every rule needs an 'alert' name")
    name = rule["alert"]
    where = f"{where}: rule {name!r}"
    _no_other_keys(rule, _RULE_KEYS, where)
    expr_text = rule.get("expr")
    if not isinstance(expr_text, str):
        raise RuleError(f"{where}: 'expr' must be a string")
    try:
        expr = parse(expr_text)
        for_s = parse_duration_ms(str(rule.get("for", "0s"))) / 1000
    except PromQLError as e:
        raise RuleError(f"{where}: {e}") from None
    if expr.value_type not in ("vector", "scalar"):
        raise RuleError(f"{where}: the expression must be an instant vector or a scalar")
    labels = _string_map(rule.get("labels"), f"{where}: labels")
    annotations = _string_map(rule.get("annotations"), f"{where}: annotations")
    try:
        return AlertRule(name, expr_text, expr, for_s, labels, annotations, group)
    except RuleError as e:
        raise RuleError(f"{where}: {e}") from None


def _string_map(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RuleError(f"{where} must be a mapping")
    return {str(k): str(v) for k, v in value.items()}


# ---------------------------------------------------------------------------- alerts


@dataclass(frozen=True)
class Alert:
    """One active alert, as of the last evaluation."""

    name: str
    labels: dict[str, str]
    """The series' labels (no ``__name__``), the rule's labels and ``alertname``."""
    annotations: dict[str, str]
    state: Literal["pending", "firing"]
    active_since: float
    """When the series first appeared in the rule's result (seconds)."""
    value: float
    """The expression's value at the last evaluation."""
    fired_since: float | None = None

    @property
    def severity(self) -> str:
        return self.labels.get("severity", "")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, except that ``value`` may be NaN or infinite."""
        return {
            "name": self.name,
            "state": self.state,
            "severity": self.severity,
            "labels": dict(self.labels),
            "annotations": dict(self.annotations),
            "active_since": self.active_since,
            "fired_since": self.fired_since,
            "value": self.value,
        }


_AlertKey = tuple[tuple[str, str], ...]


class Alerting:
    """The alert state of a rule set: call :meth:`evaluate` at each evaluation time,
    in time order (as Prometheus evaluates a group every ``evaluation_interval``)."""

    def __init__(self, rules: AlertRules) -> None:
        self.rules = rules
        self._active: list[dict[_AlertKey, Alert]] = [{} for _ in rules.rules]
        self.errors: dict[str, str] = {}
        """The last evaluation error of each failing rule, by alert name."""

    def evaluate(self, history: SampleHistory, t: float) -> list[Alert]:
        """Evaluate every rule at ``t`` (seconds); the pending and firing alerts."""
        alerts: list[Alert] = []
        for rule, active in zip(self.rules.rules, self._active, strict=True):
            try:
                self._evaluate_rule(rule, active, history, t)
                self.errors.pop(rule.name, None)
            except PromQLError as e:
                self.errors[rule.name] = str(e)
                logger.warning("alert rule %s cannot be evaluated: %s", rule.name, e)
            alerts.extend(active.values())
        return sorted(alerts, key=lambda a: (a.name, sorted(a.labels.items())))

    @staticmethod
    def _evaluate_rule(
        rule: AlertRule, active: dict[_AlertKey, Alert], history: SampleHistory, t: float
    ) -> None:
        result = evaluate(rule.expr, history, t)
        samples = [Sample({}, result)] if isinstance(result, float) else result
        current: dict[_AlertKey, tuple[dict[str, str], Sample]] = {}
        for sample in samples:
            labels = rule.alert_labels(sample)
            key = tuple(sorted(labels.items()))
            if key in current:
                raise PromQLError(
                    "vector contains metrics with the same labelset after applying alert labels"
                )
            current[key] = (labels, sample)
        for key in [key for key in active if key not in current]:
            del active[key]
        t_ms = round(t * 1000)
        for key, (labels, sample) in current.items():
            annotations = rule.render_annotations(sample)
            alert = active.get(key)
            if alert is None:
                alert = Alert(rule.name, labels, annotations, "pending", t, sample.value)
            else:
                alert = replace(alert, annotations=annotations, value=sample.value)
            held_ms = t_ms - round(alert.active_since * 1000)
            if alert.state == "pending" and held_ms >= round(rule.for_s * 1000):
                alert = replace(alert, state="firing", fired_since=t)
            active[key] = alert
