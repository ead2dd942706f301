"""The PromQL subset and the alert rules the console evaluates without a Prometheus
(``inferd/monitoring/promql.py``, ``alerting.py``): pure unit tests, then one
differential test against the real Prometheus, ``promtool test rules``.

The differential test feeds promtool the very series (Prometheus' expanding notation,
15 s apart) our evaluator reads, and asks it to confirm, at each check time, every alert
our evaluator says is firing (labels and rendered annotations), and the exact values of
a set of expressions. promtool is the Debian package, Prometheus 2.42, where a range
``[5m]`` still includes a sample exactly 5 minutes old; Prometheus 3 (what compose runs,
and what we follow) excludes it. So the expression checks run between scrapes (``4m7s``),
where both read the same samples, and the alert scenarios use counters that start at
zero or grow linearly and gauges with clear margins, whose results do not depend on that
one sample.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from inferd.monitoring import promql
from inferd.monitoring.alerting import (
    Alert,
    Alerting,
    AlertRules,
    RuleError,
    go_float,
    humanize,
    humanize_duration,
    humanize_percentage,
)
from inferd.monitoring.promql import (
    PromQLError,
    Sample,
    SampleHistory,
    evaluate,
    parse,
    parse_duration_ms,
)

ROOT = Path(__file__).resolve().parent.parent
DEPLOY_RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
PACKAGE_RULES = ROOT / "inferd" / "monitoring" / "alerts.yml"
INTERVAL_S = 15


# ----------------------------------------------------------------- series notation


def expand(notation: str) -> list[float | str]:
    """Prometheus' expanding notation, as promtool reads ``input_series``: ``a+bxn``
    (n+1 values, accumulated), ``axn``, ``_``/``_xn`` (missing), ``stale``."""
    out: list[float | str] = []
    for item in notation.split():
        if item in ("_", "stale"):
            out.append(item)
            continue
        if blanks := re.fullmatch(r"_x(\d+)", item):
            out.extend(["_"] * int(blanks.group(1)))
            continue
        match = re.fullmatch(r"(-?[\d.]+(?:e[+-]?\d+)?)(?:([+-][\d.]+)?x(\d+))?", item)
        assert match, item
        value, step = float(match.group(1)), float(match.group(2) or 0)
        for _ in range((int(match.group(3)) + 1) if match.group(3) else 1):
            out.append(value)
            value += step
    return out


def series_labels(selector: str) -> tuple[str, dict[str, str]]:
    node = parse(selector)
    assert isinstance(node, promql.VectorSelector) and node.name
    return node.name, {m.label: m.value for m in node.matchers}


def history_of(series: Mapping[str, str], retention_s: float = 7200) -> SampleHistory:
    """One scrape every 15 s from t=0 with the series' values; a missing value must
    follow ``stale`` (or come before the first value), as our history marks a series
    stale as soon as a scrape lacks it while promtool would keep its last value."""
    expanded = [(*series_labels(s), expand(v)) for s, v in series.items()]
    history = SampleHistory(retention_s)
    state = dict.fromkeys(range(len(expanded)), "before")
    for step in range(max(len(v) for _, _, v in expanded)):
        scrape = []
        for i, (name, labels, values) in enumerate(expanded):
            value = values[step] if step < len(values) else "_"
            if isinstance(value, float):
                scrape.append((name, labels, value))
                state[i] = "live"
            elif value == "stale":
                state[i] = "stale"
            else:
                assert state[i] != "live", f"{name}{labels} must end with 'stale' at {step}"
        history.add(step * INTERVAL_S, scrape)
    return history


def at(expr: str, history: SampleHistory, t: float) -> dict[str, float]:
    """An instant vector as ``{'{a="b"}': value}`` (labels sorted, the name first)."""
    result = evaluate(expr, history, t)
    assert isinstance(result, list)
    return {_text(s.labels): s.value for s in result}


def _text(labels: Mapping[str, str]) -> str:
    name = labels.get("__name__", "")
    pairs = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
    return f"{name}{{{pairs}}}"


# ------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("1 + 2 * 3", 7.0),
        ("(1 + 2) * 3", 9.0),
        ("10 - 4 - 3", 3.0),
        ("2 * 3 % 4", 2.0),
        ("2 ^ 3 ^ 2", 512.0),
        ("-2 ^ 2", -4.0),
        ("2 ^ -1", 0.5),
        ("- - 3", 3.0),
        ("1 + 1 > bool 1", 1.0),
        ("1 > bool 1 + 1", 0.0),
        ("7 / 0", math.inf),
        ("-7 / 0", -math.inf),
        ("5 % 0", math.nan),
        ("0x10 + 1e1 + .5", 26.5),
        ("time()", 90.0),
        ("scalar(vector(4)) * 2", 8.0),
    ],
)
def test_scalar_arithmetic_follows_promql_precedence(expr: str, value: float) -> None:
    result = evaluate(expr, SampleHistory(60), 90)
    assert isinstance(result, float)
    assert result == value or (math.isnan(value) and math.isnan(result))


def test_precedence_of_vector_operators() -> None:
    tree = parse("a > 1 and b or c unless d * e ^ f")
    assert isinstance(tree, promql.Binary) and tree.op == "or"
    assert isinstance(tree.lhs, promql.Binary) and tree.lhs.op == "and"
    assert isinstance(tree.lhs.lhs, promql.Binary) and tree.lhs.lhs.op == ">"
    right = tree.rhs
    assert isinstance(right, promql.Binary) and right.op == "unless"
    assert isinstance(right.rhs, promql.Binary) and right.rhs.op == "*"
    assert isinstance(right.rhs.rhs, promql.Binary) and right.rhs.rhs.op == "^"


def test_aggregation_grouping_in_either_position_and_keywords_in_any_case() -> None:
    assert parse("sum by (a) (x)") == parse("sum(x) by (a)") == parse("SUM BY (a,) (x)")
    assert parse("count without (b) (x)") == parse("count(x) without (b)")
    node = parse("x and ON(a) y")
    assert isinstance(node, promql.Binary) and node.matching == promql.VectorMatching(True, ("a",))


@pytest.mark.parametrize(
    ("text", "ms"),
    [("30s", 30_000), ("5m", 300_000), ("1h30m", 5_400_000), ("500ms", 500), ("1w", 604_800_000)],
)
def test_durations(text: str, ms: int) -> None:
    assert parse_duration_ms(text) == ms
    node = parse(f"x[{text}]")
    assert isinstance(node, promql.MatrixSelector) and node.range_ms == ms


@pytest.mark.parametrize(
    ("expr", "message", "column"),
    [
        ("sum(x", "expected ')'", 6),
        ("x[5m:1m]", "subqueries are not supported", 3),
        ("a * on(x) group_left b", "group_left (many-to-one matching) is not supported", 11),
        ("1 > 2", "comparisons between scalars must use BOOL modifier", 3),
        ("rate(x)", "rate() expects a range vector argument, got an instant vector", 8),
        ("topk(3, x)", "aggregation 'topk' is not supported", 1),
        ('{a=""}', "at least one non-empty matcher", 1),
        ("x[5q]", "not a duration", 3),
        ("x + [", "unexpected '['", 5),
        ("label_replace(x, 'a', 'b', 'c', 'd')", "unknown or unsupported function", 1),
        ("1 and 2", "set operator 'and' not allowed in binary scalar expression", 3),
        ('x{a=~"("}', "invalid regular expression", 6),
        ("x @ 100", "the @ modifier is not supported", 3),
        ("x\n  + )", "unexpected ')'", 5),
        ("(x)[5m]", "not parentheses", 4),
        ("sum(x)[5m]", "ranges are only allowed on vector selectors", 7),
    ],
)
def test_parse_errors_say_what_and_where(expr: str, message: str, column: int) -> None:
    with pytest.raises(PromQLError) as caught:
        parse(expr)
    assert message in str(caught.value)
    assert f"column {column}:" in str(caught.value)
    assert caught.value.position is not None


def test_metric_names_and_history_reach() -> None:
    node = parse('rate(a_total[5m]) / on(x) b + avg_over_time(c[30m] offset 1m) and {__name__="d"}')
    assert promql.metric_names(node) == {"a_total", "b", "c", "d"}
    assert promql.metric_names(parse('{__name__=~"a.*"}')) is None
    assert promql.history_s(node) == 31 * 60
    assert promql.history_s(parse("x")) == 300


# ------------------------------------------------------------ selectors, staleness


def test_label_matchers_are_anchored_regexes_and_empty_means_absent() -> None:
    history = history_of({'x{a="foo"}': "1", 'x{a="fo", b="1"}': "2", "x": "3", 'y{a="foo"}': "4"})
    assert at('x{a=~"fo"}', history, 0) == {'x{a="fo", b="1"}': 2.0}
    assert at('x{a!~"f.*"}', history, 0) == {"x{}": 3.0}
    assert at('x{b=""}', history, 0) == {'x{a="foo"}': 1.0, "x{}": 3.0}
    assert at('x{a!="foo", b!=""}', history, 0) == {'x{a="fo", b="1"}': 2.0}
    assert at('{a="foo"}', history, 0) == {'x{a="foo"}': 1.0, 'y{a="foo"}': 4.0}
    assert at('{__name__=~"x|y", a="foo"}', history, 0) == {'x{a="foo"}': 1.0, 'y{a="foo"}': 4.0}


def test_instant_selector_takes_the_newest_sample_within_five_minutes() -> None:
    history = SampleHistory(3600)
    history.add(0, [("x", {}, 1.0)])
    history.add(100, [("x", {}, 2.0)])
    assert at("x", history, 50) == {"x{}": 1.0}
    assert at("x", history, 399.999) == {"x{}": 2.0}
    assert at("x", history, 400) == {}  # (t - 5m, t]: a sample exactly 5m old is out
    assert at("x offset 100s", history, 150) == {"x{}": 1.0}


def test_a_series_missing_from_a_scrape_is_stale_until_it_returns() -> None:
    history = history_of({'x{i="a"}': "1 2 stale _ 5", 'x{i="b"}': "1 2 3 4 5"})
    assert at("x", history, 15) == {'x{i="a"}': 2.0, 'x{i="b"}': 2.0}
    assert at("x", history, 30) == {'x{i="b"}': 3.0}  # stale at once, not after 5m
    assert at("x", history, 59) == {'x{i="b"}': 4.0}
    assert at("x", history, 60) == {'x{i="a"}': 5.0, 'x{i="b"}': 5.0}
    assert at("x", history, 29) == {'x{i="a"}': 2.0, 'x{i="b"}': 2.0}  # the past is kept
    # a range selector skips the gap: the samples are the samples
    assert at("count_over_time(x[1m])", history, 60) == {'{i="a"}': 2.0, '{i="b"}': 4.0}


def test_range_selector_is_open_on_the_left() -> None:
    history = history_of({"x": "0+1x8"})
    assert at("count_over_time(x[1m])", history, 60) == {"{}": 4.0}  # 15, 30, 45, 60
    assert at("count_over_time(x[1m])", history, 61) == {"{}": 4.0}
    assert at("count_over_time(x[1m])", history, 74) == {"{}": 4.0}
    assert at("sum_over_time(x[1m] offset 30s)", history, 90) == {"{}": 1.0 + 2 + 3 + 4}


def test_history_keeps_the_retention_and_only_the_kept_names() -> None:
    history = SampleHistory(60, keep={"x"})
    for step in range(10):
        history.add(step * 15, [("x", {}, float(step)), ("y", {}, 1.0)])
    assert len(history) == 1 and history.last_scrape_s == 135
    assert at("count_over_time(x[10m])", history, 135) == {"{}": 5.0}  # 75 .. 135
    assert at("y", history, 135) == {}
    with pytest.raises(ValueError, match="not after"):
        history.add(135, [])


def test_history_forgets_a_series_once_all_its_samples_are_old() -> None:
    history = SampleHistory(60)
    history.add(0, [("x", {"i": "a"}, 1.0), ("x", {"i": "b"}, 1.0)])
    for t in range(15, 100, 15):
        history.add(t, [("x", {"i": "b"}, 1.0)])
    assert len(history) == 1


# ---------------------------------------------------------------- vector matching


@pytest.fixture
def matching() -> SampleHistory:
    return history_of(
        {
            'a{job="j", x="1", y="p"}': "10",
            'a{job="j", x="2", y="q"}': "20",
            'b{job="j", x="1", y="p"}': "1",
            'b{job="j", x="2", y="r"}': "2",
            'c{x="1"}': "5",
        }
    )


def test_arithmetic_matches_on_all_labels_but_the_name_and_drops_it(
    matching: SampleHistory,
) -> None:
    assert at("a + b", matching, 0) == {'{job="j", x="1", y="p"}': 11.0}
    assert at("a - ignoring(y) b", matching, 0) == {
        '{job="j", x="1"}': 9.0,
        '{job="j", x="2"}': 18.0,
    }
    assert at("a / on(x) c", matching, 0) == {'{x="1"}': 2.0}
    assert at("a * 2", matching, 0) == {
        '{job="j", x="1", y="p"}': 20.0,
        '{job="j", x="2", y="q"}': 40.0,
    }
    assert at("-c", matching, 0) == {'{x="1"}': -5.0}


def test_comparisons_filter_and_keep_the_left_value_unless_bool(matching: SampleHistory) -> None:
    assert at("a > 15", matching, 0) == {'a{job="j", x="2", y="q"}': 20.0}
    assert at("15 < a", matching, 0) == {'a{job="j", x="2", y="q"}': 20.0}  # the vector's value
    assert at("a > bool 15", matching, 0) == {
        '{job="j", x="1", y="p"}': 0.0,
        '{job="j", x="2", y="q"}': 1.0,
    }
    assert at("a > ignoring(y) b", matching, 0) == {
        'a{job="j", x="1"}': 10.0,
        'a{job="j", x="2"}': 20.0,
    }
    assert at("a < on(x) c", matching, 0) == {}
    assert at("a > on(x) c", matching, 0) == {'{x="1"}': 10.0}  # on(): only those labels


def test_set_operators(matching: SampleHistory) -> None:
    assert at("a and b", matching, 0) == {'a{job="j", x="1", y="p"}': 10.0}
    assert at("a and on(x) b", matching, 0) == {
        'a{job="j", x="1", y="p"}': 10.0,
        'a{job="j", x="2", y="q"}': 20.0,
    }
    assert at("a unless on(y) b", matching, 0) == {'a{job="j", x="2", y="q"}': 20.0}
    assert at("c or on(x) a", matching, 0) == {'c{x="1"}': 5.0, 'a{job="j", x="2", y="q"}': 20.0}
    assert at("a and nothing", matching, 0) == {}
    assert len(at("a unless nothing", matching, 0)) == 2


def test_many_to_many_matching_is_refused_as_prometheus_does(matching: SampleHistory) -> None:
    with pytest.raises(PromQLError, match="found duplicate series for the match group"):
        evaluate("c + on(job) a", matching, 0)
    with pytest.raises(PromQLError, match="many-to-one matching must be explicit"):
        evaluate(
            "a + on(job) c",
            history_of({'a{job="j", i="1"}': "1", 'a{job="j", i="2"}': "1", 'c{job="j"}': "1"}),
            0,
        )
    with pytest.raises(PromQLError, match="same labelset"):
        evaluate('abs({__name__=~"a|b", x="1"})', matching, 0)


# ------------------------------------------------------------------- aggregations


def test_aggregations_by_and_without() -> None:
    history = history_of(
        {
            'x{m="a", i="1"}': "1",
            'x{m="a", i="2"}': "3",
            'x{m="b", i="1"}': "10",
            'x{i="3"}': "-4",
        }
    )
    assert at("sum by (m) (x)", history, 0) == {'{m="a"}': 4.0, '{m="b"}': 10.0, "{}": -4.0}
    assert at("avg without (i) (x)", history, 0) == {'{m="a"}': 2.0, '{m="b"}': 10.0, "{}": -4.0}
    assert at("max(x)", history, 0) == {"{}": 10.0}
    assert at("min(x) by (i)", history, 0) == {'{i="1"}': 1.0, '{i="2"}': 3.0, '{i="3"}': -4.0}
    assert at("count(x)", history, 0) == {"{}": 4.0}
    assert at("sum(nothing)", history, 0) == {}


def test_sums_are_compensated_as_in_prometheus_3() -> None:
    history = history_of({'x{i="1"}': "1e100", 'x{i="2"}': "1", 'x{i="3"}': "-1e100"})
    assert at("sum(x)", history, 0) == {"{}": 1.0}  # a plain sum says 0
    assert at("sum_over_time(x[1m])", history, 0) == {
        '{i="1"}': 1e100,
        '{i="2"}': 1.0,
        '{i="3"}': -1e100,
    }


# ----------------------------------------------------------------------- functions


def test_rate_extrapolates_a_regular_counter_to_the_whole_range() -> None:
    history = history_of({"c_total": "0+10x40"})
    assert at("rate(c_total[5m])", history, 600)["{}"] == pytest.approx(10 / 15)
    assert at("increase(c_total[5m])", history, 600)["{}"] == pytest.approx(200.0)
    assert at("increase(c_total[1m])", history, 607)["{}"] == pytest.approx(40.0)


def test_rate_adds_counter_resets_back() -> None:
    history = history_of({"c_total": "0 10 20 5 15"})
    # (0, 60]: 10 20 5 15 → 5 + 20 (the reset) over 45 s, extrapolated 15 s to the start
    assert at("increase(c_total[1m])", history, 60)["{}"] == pytest.approx(25 * 60 / 45)
    assert at("delta(c_total[1m])", history, 60)["{}"] == pytest.approx(5 * 60 / 45)


def test_rate_extrapolates_half_an_interval_where_the_series_starts_and_not_below_zero() -> None:
    late = history_of({"c_total": "_x16 100+10x4"})  # appears at 240 s with 100
    # 40 over 60 s; the start is 240 s away: extrapolate 7.5 s only
    assert at("increase(c_total[5m])", late, 300)["{}"] == pytest.approx(40 * 67.5 / 60)
    low = history_of({"c_total": "_x16 2+10x4"})
    # would reach zero 3 s before its first sample: extrapolate 3 s, not 7.5 s
    assert at("increase(c_total[5m])", low, 300)["{}"] == pytest.approx(40 * 63 / 60)
    assert at("rate(c_total[5m])", history_of({"c_total": "_x19 5"}), 300) == {}


def test_instant_rates_and_over_time_functions() -> None:
    history = history_of({"c_total": "0 10 20 5", "g": "1 4 2 8"})
    assert at("irate(c_total[1m])", history, 45) == {"{}": 5 / 15}  # a reset: the last value
    assert at("irate(c_total[1m])", history, 30) == {"{}": 10 / 15}
    assert at("idelta(g[1m])", history, 45) == {"{}": 6.0}
    assert at("avg_over_time(g[30s])", history, 45) == {"{}": 5.0}  # (15, 45]: 2 and 8
    assert at("min_over_time(g[2m])", history, 45) == {"{}": 1.0}
    assert at("max_over_time(g[2m])", history, 45) == {"{}": 8.0}
    assert at("count_over_time(g[2m])", history, 45) == {"{}": 4.0}
    assert at("clamp(g, 2, 5)", history, 45) == {"{}": 5.0}
    assert at("clamp_min(g, 9)", history, 45) == {"{}": 9.0}
    assert at("clamp_max(g, 3)", history, 45) == {"{}": 3.0}
    assert at("abs(g - 10)", history, 45) == {"{}": 2.0}
    assert at("ceil(g / 3)", history, 45) == {"{}": 3.0}
    assert at("floor(g / 3)", history, 45) == {"{}": 2.0}


def buckets(counts: dict[str, float]) -> SampleHistory:
    """One scrape of an ``h_bucket{m="a"}`` histogram: ``{le: count}``."""
    history = SampleHistory(60)
    history.add(0, [("h_bucket", {"le": le, "m": "a"}, v) for le, v in counts.items()])
    return history


@pytest.mark.parametrize(
    ("q", "counts", "expected"),
    [
        (0.5, {"0.1": 10, "0.5": 30, "1": 40, "+Inf": 40}, 0.1 + 0.4 * (10 / 20)),
        (0.9, {"0.1": 10, "0.5": 30, "1": 40, "+Inf": 50}, 1.0),  # in +Inf: the bound below
        (0.99, {"0.5": 30, "0.1": 10, "+Inf": 100}, 0.5),  # in any order
        (0.05, {"0.1": 10, "0.5": 30, "+Inf": 100}, 0.1 * (5 / 10)),  # the lowest from 0
        (0.05, {"-1": 10, "0.5": 30, "+Inf": 100}, -1.0),  # the lowest bound when ≤ 0
        (0.5, {"0.1": 10, "0.5": 30}, math.nan),  # no +Inf bucket
        (0.5, {"0.1": 0, "+Inf": 0}, math.nan),  # no observations
        (0.5, {"+Inf": 10}, math.nan),  # a single bucket
        (0.75, {"0.1": 10, "0.5": 8, "1": 20, "+Inf": 20}, 0.5 + 0.5 * (5 / 10)),  # monotonic
        (1.5, {"0.1": 10, "+Inf": 20}, math.inf),
        (-1, {"0.1": 10, "+Inf": 20}, -math.inf),
    ],
)
def test_histogram_quantile_follows_prometheus_buckets(
    q: float, counts: dict[str, float], expected: float
) -> None:
    result = at(f"histogram_quantile({q}, h_bucket)", buckets(counts), 0)
    assert list(result) == ['{m="a"}']
    value = result['{m="a"}']
    assert value == pytest.approx(expected) or (math.isnan(expected) and math.isnan(value))


def test_histogram_quantile_groups_by_all_labels_but_le() -> None:
    history = SampleHistory(60)
    history.add(
        0,
        [
            ("h_bucket", {"le": "1", "m": "a"}, 5.0),
            ("h_bucket", {"le": "+Inf", "m": "a"}, 10.0),
            ("h_bucket", {"le": "1", "m": "b"}, 10.0),
            ("h_bucket", {"le": "+Inf", "m": "b"}, 10.0),
            ("h_bucket", {"le": "oops", "m": "b"}, 10.0),
        ],
    )
    assert at("histogram_quantile(0.5, h_bucket)", history, 0) == {'{m="a"}': 1.0, '{m="b"}': 0.5}


def test_evaluate_refuses_a_range_vector() -> None:
    with pytest.raises(PromQLError, match="a range vector cannot be evaluated"):
        evaluate("x[5m]", SampleHistory(60), 0)


# ----------------------------------------------------------------- the shipped rules


def test_the_package_copy_of_the_rules_is_the_deployed_file() -> None:
    assert PACKAGE_RULES.read_bytes() == DEPLOY_RULES.read_bytes()


def test_the_shipped_rules_load() -> None:
    rules = AlertRules.shipped()
    assert [r.name for r in rules] == [
        "InferdHighP99Latency",
        "InferdHighErrorRate",
        "InferdNoReadyReplica",
        "InferdReplicaRestarting",
        "InferdLoadShedding",
        "InferdGPUUtilizationLow",
        "InferdGPUUtilizationHigh",
        "InferdAccuracyBelowThreshold",
        "InferdInputDrift",
        "InferdInferenceLogDropping",
    ]
    assert rules.history_s() == 1800
    assert rules.metric_names() == {
        "inferd_request_duration_seconds_bucket",
        "inferd_requests_total",
        "inferd_replicas",
        "inferd_replica_restarts_total",
        "inferd_requests_shed_total",
        "inferd_gpu_utilization_ratio",
        "inferd_model_accuracy",
        "inferd_model_accuracy_threshold",
        "inferd_model_feedback",
        "inferd_drift_psi",
        "inferd_drift_psi_threshold",
        "inferd_inference_log_dropped_rows_total",
    }
    assert AlertRules.load(DEPLOY_RULES) == rules


@dataclass
class Scenario:
    """Series (promtool's notation, 15 s apart) and, at whole minutes, the alerts our
    evaluator must report (``"Alert state label=value ..."``; severity aside)."""

    name: str
    series: dict[str, str]
    expect: dict[int, set[str]]
    annotations: dict[str, dict[str, str]] = field(default_factory=dict)
    """At the last ``expect`` minute: annotations of the alert with that description."""


BUCKET = "inferd_request_duration_seconds_bucket"
RESTARTS = "inferd_replica_restarts_total"
SCENARIOS = [
    Scenario(
        "latency",
        {
            # model "slow": every request under 100 ms for 10 minutes, then 0.5-1 s
            f'{BUCKET}{{model="slow", api="v1", le="0.1"}}': "0+10x40 400x119",
            f'{BUCKET}{{model="slow", api="v1", le="0.5"}}': "0+10x40 400x119",
            f'{BUCKET}{{model="slow", api="v1", le="1"}}': "0+10x160",
            f'{BUCKET}{{model="slow", api="v1", le="+Inf"}}': "0+10x160",
            **{
                f'{BUCKET}{{model="fast", api="{api}", le="{le}"}}': "0+5x160"
                for api in ("v1", "v2")
                for le in ("0.1", "0.5", "1", "+Inf")
            },
        },
        {
            10: set(),
            11: {"InferdHighP99Latency pending model=slow"},
            15: {"InferdHighP99Latency pending model=slow"},
            16: {"InferdHighP99Latency firing model=slow"},
        },
        {
            "InferdHighP99Latency firing model=slow": {
                "summary": "p99 latency of slow above 500 ms",
                "description": "p99 over 5 minutes is 995ms.",
            }
        },
    ),
    Scenario(
        "errors",
        {
            'inferd_requests_total{model="a", version="1", api="v1", code="200"}': "0+100x160",
            'inferd_requests_total{model="a", version="1", api="v1", code="500"}': "0x40 10+10x119",
            'inferd_requests_total{model="b", version="1", api="v1", code="200"}': "0+100x160",
            'inferd_requests_total{model="b", version="1", api="v1", code="503"}': "0x160",
            'inferd_requests_total{model="c", version="1", api="v1", code="200"}': "0+1000x160",
            'inferd_requests_total{model="c", version="1", api="v1", code="500"}': "0+1x160",
        },
        {
            10: set(),
            11: {"InferdHighErrorRate pending model=a"},
            16: {"InferdHighErrorRate firing model=a"},
        },
        {
            "InferdHighErrorRate firing model=a": {
                "summary": "a answers more than 1 % errors",
                "description": "9.091% of requests failed (5xx) over 5 minutes.",
            }
        },
    ),
    Scenario(
        "replicas",
        {
            # "a": its ready replica fails at 5m15s and comes back at 10m30s
            'inferd_replicas{model="a", version="1", state="ready"}': "1x20 0x21 1x39",
            'inferd_replicas{model="a", version="1", state="starting"}': "0x20 1x21 0x39",
            # "b": its ready series disappears (stale) at 5m15s
            'inferd_replicas{model="b", version="1", state="ready"}': "1x20 stale",
            'inferd_replicas{model="b", version="1", state="starting"}': "0x20 1x61",
            'inferd_replicas{model="c", version="1", state="ready"}': "2x82",
        },
        {
            5: set(),
            6: {"InferdNoReadyReplica pending model=a", "InferdNoReadyReplica pending model=b"},
            7: {"InferdNoReadyReplica pending model=a", "InferdNoReadyReplica pending model=b"},
            8: {"InferdNoReadyReplica firing model=a", "InferdNoReadyReplica firing model=b"},
            11: {"InferdNoReadyReplica firing model=b"},
        },
        {"InferdNoReadyReplica firing model=b": {"summary": "b has no ready replica"}},
    ),
    Scenario(
        "restarts",
        {
            f'{RESTARTS}{{model="a", version="1", replica="a-1-0"}}': "0x20 1 2 3 4 4x56",
            # first seen at 5m with 10 restarts: extrapolated half an interval back
            f'{RESTARTS}{{model="a", version="1", replica="a-1-1"}}': "_x20 10 11 12 13 14 15x56",
            f'{RESTARTS}{{model="b", version="1", replica="b-1-0"}}': "0 1 2 3 3x77",
        },
        {
            5: set(),
            6: {
                "InferdReplicaRestarting firing model=a replica=a-1-0 version=1",
                "InferdReplicaRestarting firing model=a replica=a-1-1 version=1",
            },
            10: {
                "InferdReplicaRestarting firing model=a replica=a-1-0 version=1",
                "InferdReplicaRestarting firing model=a replica=a-1-1 version=1",
            },
        },
        {
            "InferdReplicaRestarting firing model=a replica=a-1-1 version=1": {
                "summary": "replica a-1-1 restarted 5.125 times in 15 minutes"
            }
        },
    ),
    Scenario(
        "shedding",
        {
            'inferd_requests_shed_total{model="a", priority="low"}': "0x40 1+1x119",
            'inferd_requests_shed_total{model="a", priority="high"}': "0x160",
        },
        {
            10: set(),
            11: {"InferdLoadShedding pending model=a priority=low"},
            16: {"InferdLoadShedding firing model=a priority=low"},
        },
        {
            "InferdLoadShedding firing model=a priority=low": {
                "summary": "a sheds low requests: it needs capacity"
            }
        },
    ),
    Scenario(
        "gpu",
        {
            'inferd_gpu_utilization_ratio{gpu="0"}': "0.1x160",
            'inferd_gpu_utilization_ratio{gpu="1"}': "0.5x40 0.98x119",
            'inferd_gpu_utilization_ratio{gpu="2"}': "0.5x160",
        },
        {
            19: {"InferdGPUUtilizationLow pending gpu=0"},
            20: {"InferdGPUUtilizationLow pending gpu=0", "InferdGPUUtilizationHigh pending gpu=1"},
            29: {"InferdGPUUtilizationLow pending gpu=0", "InferdGPUUtilizationHigh pending gpu=1"},
            30: {"InferdGPUUtilizationLow firing gpu=0", "InferdGPUUtilizationHigh firing gpu=1"},
        },
        {
            "InferdGPUUtilizationHigh firing gpu=1": {
                "summary": "GPU 1 above 95 % busy for 10 minutes: saturated"
            }
        },
    ),
    Scenario(
        "accuracy",
        {
            'inferd_model_accuracy{model="a", version="1"}': "0.9x20 0.7x139",
            'inferd_model_accuracy_threshold{model="a", version="1"}': "0.8x160",
            'inferd_model_feedback{model="a", version="1"}': "30x160",
            'inferd_model_accuracy{model="b", version="1"}': "0.7x160",
            'inferd_model_accuracy_threshold{model="b", version="1"}': "0.8x160",
            'inferd_model_feedback{model="b", version="1"}': "5x160",
        },
        {
            5: set(),
            6: {"InferdAccuracyBelowThreshold pending model=a version=1"},
            16: {"InferdAccuracyBelowThreshold firing model=a version=1"},
        },
        {
            "InferdAccuracyBelowThreshold firing model=a version=1": {
                "summary": "a 1 accuracy fell below its threshold",
                "description": "accuracy over the last hour of feedback is 70%.",
            }
        },
    ),
    Scenario(
        "drift",
        {
            # feature x of a:1 moves at 5m15s; y stays under its line; b's x is at it
            'inferd_drift_psi{model="a", version="1", feature="x"}': "0.05x20 0.9x139",
            'inferd_drift_psi_threshold{model="a", version="1", feature="x"}': "0.2x160",
            'inferd_drift_psi{model="a", version="1", feature="y"}': "0.1x160",
            'inferd_drift_psi_threshold{model="a", version="1", feature="y"}': "0.2x160",
            'inferd_drift_psi{model="b", version="2", feature="x"}': "0.19x160",
            'inferd_drift_psi_threshold{model="b", version="2", feature="x"}': "0.2x160",
        },
        {
            5: set(),
            6: {"InferdInputDrift pending feature=x model=a version=1"},
            20: {"InferdInputDrift pending feature=x model=a version=1"},
            21: {"InferdInputDrift firing feature=x model=a version=1"},
        },
        {
            "InferdInputDrift firing feature=x model=a version=1": {
                "summary": "a 1: input x drifted from its reference",
                "description": "PSI 0.9 over its last window of inputs (GET "
                "/api/v1/models/a/versions/1/drift names every feature that moved).",
            }
        },
    ),
    Scenario(
        "log",
        {"inferd_inference_log_dropped_rows_total": "0x40 2+2x119"},
        {
            10: set(),
            11: {"InferdInferenceLogDropping pending"},
            15: {"InferdInferenceLogDropping pending"},
            16: {"InferdInferenceLogDropping firing"},
        },
        {
            "InferdInferenceLogDropping firing": {
                "summary": "inference log rows are being dropped: the database is behind"
            }
        },
    ),
]


def describe(alert: Alert) -> str:
    labels = sorted(
        f"{k}={v}" for k, v in alert.labels.items() if k not in ("alertname", "severity")
    )
    return " ".join([alert.name, alert.state, *labels])


def run_scenario(scenario: Scenario) -> dict[int, list[Alert]]:
    """Our alerts at every whole minute up to the last check, evaluated every minute
    from 0 as promtool's ``evaluation_interval: 1m`` does."""
    history = history_of(scenario.series)
    alerting = Alerting(AlertRules.shipped())
    out = {}
    for minute in range(max(scenario.expect) + 1):
        out[minute] = alerting.evaluate(history, minute * 60)
        assert alerting.errors == {}
    return out


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_each_shipped_rule_fires_only_when_it_should(scenario: Scenario) -> None:
    alerts = run_scenario(scenario)
    for minute, expected in scenario.expect.items():
        assert {describe(a) for a in alerts[minute]} == expected, f"at {minute}m"
    last = {describe(a): a for a in alerts[max(scenario.expect)]}
    for described, expected_annotations in scenario.annotations.items():
        assert last[described].annotations == expected_annotations


def test_severity_labels_and_the_dict_form() -> None:
    alerts = run_scenario(SCENARIOS[1])[16]
    assert [a.severity for a in alerts] == ["critical"]
    alert = alerts[0]
    assert alert.labels == {
        "model": "a",
        "severity": "critical",
        "alertname": "InferdHighErrorRate",
    }
    assert alert.to_dict() == {
        "name": "InferdHighErrorRate",
        "state": "firing",
        "severity": "critical",
        "labels": alert.labels,
        "annotations": alert.annotations,
        "active_since": 660.0,
        "fired_since": 960.0,
        "value": pytest.approx(10 / 110),
    }


# ------------------------------------------------------------- the state machine


RULE = """
groups:
  - name: g
    rules:
      - alert: High
        expr: x > 1
        for: 2m
        labels: {severity: warning, team: "{{ $labels.team }}-oncall"}
        annotations:
          summary: "{{ $labels.instance }} at {{ $value }}"
      - alert: Now
        expr: x > 5
        annotations: {summary: "{{humanize $value}}"}
"""


def test_pending_firing_resolved_and_pending_again() -> None:
    alerting = Alerting(AlertRules.parse(RULE))
    history = SampleHistory(3600)
    values = [0, 2, 2, 2, 9, 0, 2, 2]  # one scrape a minute

    def step(minute: int) -> list[str]:
        history.add(minute * 60, [("x", {"instance": "i1", "team": "ml"}, float(values[minute]))])
        return [
            f"{a.name}:{a.state}:{a.active_since:g}"
            for a in alerting.evaluate(history, minute * 60)
        ]

    assert step(0) == []
    assert step(1) == ["High:pending:60"]
    assert step(2) == ["High:pending:60"]
    assert step(3) == ["High:firing:60"]  # held for 2m
    assert step(4) == ["High:firing:60", "Now:firing:240"]  # no `for`: fires at once
    assert step(5) == []  # resolved: gone
    assert step(6) == ["High:pending:360"]  # a new alert, pending again
    alert = alerting.evaluate(history, 400)[0]  # evaluations need not follow scrapes
    assert alert.labels == {
        "instance": "i1",
        "team": "ml-oncall",
        "severity": "warning",
        "alertname": "High",
    }
    assert alert.annotations == {"summary": "i1 at 2"}


def test_a_failing_rule_keeps_its_alerts_and_says_why() -> None:
    rules = AlertRules.parse("groups: [{name: g, rules: [{alert: A, expr: 'x + on(job) y > 0'}]}]")
    alerting = Alerting(rules)
    history = SampleHistory(3600)
    history.add(0, [("x", {"job": "j"}, 1.0), ("y", {"job": "j"}, 1.0)])
    assert [a.state for a in alerting.evaluate(history, 0)] == ["firing"]
    history.add(
        15,
        [
            ("x", {"job": "j"}, 1.0),
            ("y", {"job": "j", "i": "1"}, 1.0),
            ("y", {"job": "j", "i": "2"}, 1.0),
        ],
    )
    assert [a.state for a in alerting.evaluate(history, 15)] == ["firing"]
    assert "many-to-many" in alerting.errors["A"]


def test_alert_labels_must_stay_distinct() -> None:
    rules = AlertRules.parse(
        "groups: [{name: g, rules: [{alert: A, expr: 'x', labels: {i: same}}]}]"
    )
    alerting = Alerting(rules)
    history = SampleHistory(60)
    history.add(0, [("x", {"i": "1"}, 1.0), ("x", {"i": "2"}, 1.0)])
    assert alerting.evaluate(history, 0) == []
    assert "same labelset after applying alert labels" in alerting.errors["A"]


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ("{record: r, expr: x}", "recording rules are not supported"),
        ("{alert: A, expr: x, keep_firing_for: 5m}", "unsupported field(s) keep_firing_for"),
        ("{alert: A, expr: 'x +'}", "rule 'A': parse error at line 1, column 4"),
        ("{alert: A, expr: x, for: 5minutes}", "not a duration"),
        ("{alert: A, expr: 'x[5m]'}", "instant vector or a scalar"),
        (
            "{alert: A, expr: x, annotations: {s: '{{ $labels.a | humanize }}'}}",
            "formatters apply to $value",
        ),
        (
            "{alert: A, expr: x, annotations: {s: '{{ .Value | printf \"%.2f\" }}'}}",
            "is not supported",
        ),
        ("{alert: A, expr: x, annotations: {s: '{{ if $value }}x{{ end }}'}}", "is not supported"),
        ("{alert: A, expr: x, annotations: {s: 'a }} b'}}", "unbalanced template braces"),
    ],
)
def test_rules_this_module_cannot_evaluate_faithfully_are_refused(rule: str, message: str) -> None:
    with pytest.raises(RuleError) as caught:
        AlertRules.parse(f"groups: [{{name: g, rules: [{rule}]}}]", "r.yml")
    assert message in str(caught.value) and str(caught.value).startswith("r.yml: group 'g'")


# promtool printed these for the same values (Prometheus 2.42, same template functions
# as Prometheus 3.5 through prometheus/common).
@pytest.mark.parametrize(
    ("value", "as_value", "duration", "percentage", "humanized"),
    [
        (1234567, "1.234567e+06", "14d 6h 56m 7s", "1.235e+08%", "1.235M"),
        (123456, "123456", "1d 10h 17m 36s", "1.235e+07%", "123.5k"),
        (0.00001234, "1.234e-05", "12.34us", "0.001234%", "12.34u"),
        (1e21, "1e+21", "-106751991167300d -15h -30m -8s", "1e+23%", "1Z"),
        (-0.5, "-0.5", "-500ms", "-50%", "-500m"),
        (1e6, "1e+06", "11d 13h 46m 40s", "1e+08%", "1M"),
        (0.0001, "0.0001", "100us", "0.01%", "100u"),
        (93784.5, "93784.5", "1d 2h 3m 4s", "9.378e+06%", "93.78k"),
        (math.inf, "+Inf", "+Inf", "+Inf%", "+Inf"),
        (0.0, "0", "0s", "0%", "0"),
        (1.5, "1.5", "1.5s", "150%", "1.5"),
        (-3700, "-3700", "-1h 1m 40s", "-3.7e+05%", "-3.7k"),
        (0.1 + 0.2, "0.30000000000000004", "300ms", "30%", "300m"),
    ],
)
def test_template_functions_format_as_go_and_prometheus(
    value: float, as_value: str, duration: str, percentage: str, humanized: str
) -> None:
    assert go_float(value) == as_value
    assert humanize_duration(value) == duration
    assert humanize_percentage(value) == percentage
    assert humanize(value) == humanized
    assert go_float(math.nan) == "NaN" and humanize_duration(math.nan) == "NaN"


def test_sample_is_a_plain_pair() -> None:
    history = history_of({'x{a="b"}': "3"})
    assert evaluate("x", history, 0) == [Sample({"__name__": "x", "a": "b"}, 3.0)]


# ------------------------------------------------- differential: the real Prometheus

FUNCTIONS = Scenario(
    "functions",
    {
        'x_total{i="reset"}': "0 10 20 5 15 25 2 12+10x13",
        'x_total{i="late"}': "_x8 100+7x12",
        'g{i="a"}': "1 4 2 8 5 7 3 9 6 0 -3 12 4x8",
        'g{i="b"}': "0.25x20",
        'h_bucket{le="0.25"}': "0+1x20",
        'h_bucket{le="1"}': "0+3x20",
        'h_bucket{le="+Inf"}': "0+4x20",
    },
    {5: set()},
)
EXPRESSIONS = [
    "rate(x_total[1m])",
    "rate(x_total[2m])",
    "increase(x_total[2m])",
    "increase(x_total[5m])",
    "irate(x_total[1m])",
    "delta(g[2m])",
    "idelta(g[1m])",
    "avg_over_time(g{i='b'}[2m])",
    "max_over_time(g[2m])",
    "min_over_time(g[2m])",
    "sum_over_time(g[2m])",
    "count_over_time(x_total[2m])",
    "sum(x_total)",
    "sum by (i) (rate(x_total[2m]))",
    "avg(g)",
    "count(g > 2)",
    "x_total > 50",
    "x_total > bool 50",
    "-g * 2 + 1",
    "g / on(i) g{i='a'}",
    "g unless on(i) g > 5",
    "histogram_quantile(0.9, h_bucket)",
    "histogram_quantile(0.5, rate(h_bucket[1m]))",
    "histogram_quantile(0.99, rate(h_bucket[2m]))",
    "clamp(g, 2, 5)",
    "abs(g - 5)",
]
EXPRESSION_TIMES = ("1m52s", "2m7s", "4m7s")
RULE_EXPRESSIONS = {
    # the alert expressions' inner values where a scenario moves (between scrapes)
    "latency": [
        "histogram_quantile(0.99, sum by (model, le) "
        "(rate(inferd_request_duration_seconds_bucket[5m])))"
    ],
    "errors": [
        'sum by (model) (rate(inferd_requests_total{code=~"5.."}[5m]))'
        " / sum by (model) (rate(inferd_requests_total[5m]))"
    ],
    "restarts": ["increase(inferd_replica_restarts_total[15m])"],
}


def _go_duration(seconds: int) -> str:
    minutes, rest = divmod(seconds, 60)
    return f"{minutes}m{rest}s" if rest else f"{minutes}m"


def _promtool_group(
    scenario: Scenario, expressions: list[str], times: tuple[str, ...]
) -> dict[str, Any]:
    alerts = run_scenario(scenario)
    names = [r.name for r in AlertRules.shipped()]
    alert_tests = [
        {
            "eval_time": f"{minute}m",
            "alertname": name,
            "exp_alerts": [
                {
                    "exp_labels": {k: v for k, v in a.labels.items() if k != "alertname"},
                    "exp_annotations": a.annotations,
                }
                for a in alerts[minute]
                if a.name == name and a.state == "firing"  # promtool lists firing ones
            ],
        }
        for minute in scenario.expect
        for name in names
    ]
    history = history_of(scenario.series)
    expr_tests = []
    for expr in expressions:
        for when in times:
            seconds = sum(
                int(n) * (60 if u == "m" else 1) for n, u in re.findall(r"(\d+)([ms])", when)
            )
            result = evaluate(expr, history, seconds)
            assert isinstance(result, list) and all(not math.isnan(s.value) for s in result)
            samples = [{"labels": _text(s.labels), "value": s.value} for s in result]
            expr_tests.append({"expr": expr, "eval_time": when, "exp_samples": samples})
    return {
        "name": scenario.name,
        "interval": f"{INTERVAL_S}s",
        "input_series": [{"series": s, "values": v} for s, v in scenario.series.items()],
        "alert_rule_test": alert_tests,
        "promql_expr_test": expr_tests,
    }


@pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool not installed (scripts/ensure-services.sh installs the prometheus package)",
)
def test_promtool_agrees_with_our_alerts_and_values(tmp_path: Path) -> None:
    groups = [_promtool_group(FUNCTIONS, EXPRESSIONS, EXPRESSION_TIMES)]
    for scenario in SCENARIOS:
        last = max(scenario.expect) * 60
        times = tuple(_go_duration(t) for t in (last - 293, last - 173, last - 53) if t > 0)
        groups.append(_promtool_group(scenario, RULE_EXPRESSIONS.get(scenario.name, []), times))
    firing = sum(len(t["exp_alerts"]) for g in groups for t in g["alert_rule_test"])
    values = sum(len(t["exp_samples"]) for g in groups for t in g["promql_expr_test"])
    assert firing >= 12 and values >= 120, (firing, values)  # what promtool confirms is not nothing
    tests = {"rule_files": [str(DEPLOY_RULES)], "evaluation_interval": "1m", "tests": groups}
    path = tmp_path / "alerts_test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False, width=1000))
    run = subprocess.run(
        ["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
