"""Unit tests for the benchmark's arithmetic, request bodies and reports (no sockets)."""

from __future__ import annotations

import json
import math
import random
import re
import uuid
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from rich.table import Table

from inferd.bench.payloads import (
    WORDS,
    JsonlPayloads,
    PromptLengths,
    TemplatePayloads,
    fixed,
)
from inferd.bench.report import (
    plot_sweep,
    plot_timeline,
    render_summary,
    render_sweep,
    write_json,
)
from inferd.bench.stats import (
    Sample,
    Summary,
    parse_duration,
    parse_slo,
    percentile,
    summarize,
    timeline,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# --- percentile ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_percentile_matches_numpy_linear(n: int) -> None:
    rng = random.Random(n)
    values = [rng.expovariate(1.0) for _ in range(n)]
    for q in (0, 1, 10, 25, 50, 75, 90, 95, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12)


def test_percentile_edge_cases() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([7.0], 0) == percentile([7.0], 99) == 7.0
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0
    assert percentile([3.0, 1.0, 2.0], 100) == 3.0
    assert percentile([0.0, 10.0], 25) == 2.5
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)
    with pytest.raises(ValueError):
        percentile([1.0], -1)


# --- parsing ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("2s", 2.0),
        ("1.5s", 1.5),
        ("250us", 250e-6),
        ("1m", 60.0),
        ("1h", 3600.0),
        ("3", 3.0),
        ("0.25", 0.25),
        (" 10 ms ", 0.01),
        ("0s", 0.0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "ms", "abc", "-1s", "5 parsecs", "1.2.3s", "inf", "nan"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


def test_parse_slo() -> None:
    assert parse_slo("ttft=500ms,latency=2s,itl=50ms") == {
        "ttft": 0.5,
        "latency": 2.0,
        "itl": 0.05,
    }
    assert parse_slo(" latency = 1s , ") == {"latency": 1.0}
    assert parse_slo("") == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tpot=20ms", "allowed: latency, ttft, itl"),
        ("latency", "KEY=DURATION"),
        ("latency=fast", "invalid duration"),
        ("latency=0s", "positive"),
        ("latency=1s,latency=2s", "twice"),
    ],
)
def test_parse_slo_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_slo(text)


# --- summarize ----------------------------------------------------------------------------


def _mixed_samples() -> list[Sample]:
    return [
        Sample(0.0, 0.100, 200),
        Sample(0.1, 0.200, 200),
        Sample(0.2, 0.300, 200),
        Sample(0.3, 0.400, 200),
        Sample(0.4, 0.001, 503, "http_503"),
        Sample(0.5, 0.002, 503, "http_503"),
        Sample(0.6, 5.000, 0, "timeout"),
    ]


def test_summarize_counts_and_rates() -> None:
    summary = summarize(_mixed_samples(), duration_s=2.0)
    assert summary.requests == 7
    assert summary.successes == 4
    assert summary.errors == 3
    assert summary.requests == summary.successes + summary.errors
    assert summary.errors_by_kind == {"http_503": 2, "timeout": 1}
    assert summary.status_counts == {"0": 1, "200": 4, "503": 2}
    assert sum(summary.status_counts.values()) == summary.requests
    assert summary.rps == 3.5
    assert summary.success_rps == 2.0
    assert summary.duration_s == 2.0


def test_summarize_latency_over_successes_only() -> None:
    latency = summarize(_mixed_samples(), duration_s=2.0).latency
    ok = [0.1, 0.2, 0.3, 0.4]
    assert latency["mean"] == 250.0
    assert latency["max"] == 400.0
    for q in (50, 90, 95, 99):
        assert latency[f"p{q}"] == round(float(np.percentile(ok, q)) * 1000, 3)


def test_summarize_without_streams_or_slo_omits_those_keys() -> None:
    summary = summarize(_mixed_samples(), duration_s=2.0)
    assert summary.ttft is None and summary.goodput_requests is None
    d = summary.to_dict()
    for key in ("ttft", "itl", "output_tokens", "output_tokens_per_s", "goodput_requests"):
        assert key not in d
    assert d["latency"]["p50"] == 250.0
    json.dumps(d, allow_nan=False)


def test_summarize_empty_and_zero_duration() -> None:
    summary = summarize([], duration_s=0.0)
    assert summary.requests == summary.successes == summary.errors == 0
    assert summary.rps == summary.success_rps == 0.0
    assert set(summary.latency.values()) == {None}
    json.dumps(summary.to_dict(), allow_nan=False)


def _stream_samples() -> list[Sample]:
    return [
        Sample(0.0, 1.0, 200, None, ttft=0.25, itl=[0.25, 0.25, 0.25], output_tokens=4),
        Sample(0.0, 2.0, 200, None, ttft=0.5, itl=[0.5, 0.5, 0.5], output_tokens=4),
        Sample(0.0, 0.1, 200, None, ttft=0.1, itl=[], output_tokens=1),
        # An error with partial tokens: excluded from every stream figure.
        Sample(0.0, 9.0, 200, "closed", ttft=9.0, itl=[9.0], output_tokens=2),
    ]


def test_summarize_streams() -> None:
    summary = summarize(_stream_samples(), duration_s=4.0)
    assert summary.ttft is not None and summary.itl is not None
    assert summary.ttft["p50"] == 250.0
    assert summary.ttft["max"] == 500.0
    assert summary.itl["mean"] == 375.0
    assert summary.itl["max"] == 500.0
    assert summary.itl["p50"] == 375.0
    assert summary.output_tokens == 9
    assert summary.output_tokens_per_s == 2.25
    assert summary.errors_by_kind == {"closed": 1}


@pytest.mark.parametrize(
    ("slo", "good"),
    [
        # At exactly the threshold a request meets it (<=).
        ({"latency": 1.0}, 2),
        ({"latency": 0.999}, 1),
        ({"ttft": 0.25}, 2),
        ({"ttft": 0.1}, 1),
        # itl is the request's mean gap; a one-token stream has no gap and meets it.
        ({"itl": 0.25}, 2),
        ({"itl": 0.5}, 3),
        ({"itl": 0.2}, 1),
        ({"latency": 1.0, "ttft": 0.1}, 1),
        ({}, 3),
    ],
)
def test_goodput_each_slo_kind(slo: dict[str, float], good: int) -> None:
    summary = summarize(_stream_samples(), duration_s=2.0, slo=slo)
    assert summary.goodput_requests == good
    assert summary.goodput_rps == good / 2.0
    assert summary.to_dict()["goodput_requests"] == good


def test_goodput_without_stream_data_fails_ttft_and_itl() -> None:
    samples = [Sample(0.0, 0.1, 200), Sample(0.0, 0.2, 200)]
    assert summarize(samples, 1.0, {"ttft": 10.0}).goodput_requests == 0
    assert summarize(samples, 1.0, {"itl": 10.0}).goodput_requests == 0
    assert summarize(samples, 1.0, {"latency": 0.15}).goodput_requests == 1


def test_slo_parsed_threshold_is_inclusive() -> None:
    samples = [Sample(0.0, 0.5, 200), Sample(0.0, 0.5000001, 200)]
    assert summarize(samples, 1.0, parse_slo("latency=500ms")).goodput_requests == 1


# --- timeline ----------------------------------------------------------------------------


def test_timeline_buckets_by_completion_time() -> None:
    samples = [
        Sample(10.0, 0.5, 200),  # completes at t=0.5
        Sample(10.2, 0.6, 200),  # t=0.8
        Sample(10.3, 0.9, 503, "http_503"),  # t=1.2
        Sample(10.5, 2.7, 200),  # t=3.2 (bucket 2 stays empty)
    ]
    rows = timeline(samples, bucket_s=1.0)
    assert [row["t"] for row in rows] == [0.0, 1.0, 2.0, 3.0]
    assert [row["requests"] for row in rows] == [2, 1, 0, 1]
    assert [row["errors"] for row in rows] == [0, 1, 0, 0]
    assert rows[0]["p50_ms"] == 550.0
    assert rows[0]["p99_ms"] == round(float(np.percentile([500, 600], 99)), 3)
    assert rows[1]["p50_ms"] is None and rows[2]["p99_ms"] is None
    assert rows[3]["p50_ms"] == 2700.0
    assert sum(row["requests"] for row in rows) == len(samples)


def test_timeline_half_second_buckets_and_bad_input() -> None:
    rows = timeline([Sample(0.0, 0.1, 200), Sample(0.0, 0.7, 200)], bucket_s=0.5)
    assert [(row["t"], row["requests"], row["rps"]) for row in rows] == [
        (0.0, 1, 2.0),
        (0.5, 1, 2.0),
    ]
    assert timeline([]) == []
    with pytest.raises(ValueError):
        timeline([Sample(0.0, 0.1, 200)], bucket_s=0)


# --- payloads -----------------------------------------------------------------------------


def test_jsonl_payloads_cycle_and_skip_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "bodies.jsonl"
    path.write_text('{"a": 1}\n\n  \n{"a": 2}\r\n[3]\n', encoding="utf-8")
    source = JsonlPayloads(path)
    got = [json.loads(source.next()) for _ in range(7)]
    assert got == [{"a": 1}, {"a": 2}, [3], {"a": 1}, {"a": 2}, [3], {"a": 1}]
    assert isinstance(source.next(), bytes)


def test_jsonl_payloads_reject_bad_line_and_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n\n{"a": \n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3"):
        JsonlPayloads(path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no request bodies"):
        JsonlPayloads(empty)


def test_fixed_payload() -> None:
    assert json.loads(fixed({"x": [1, 2]}).next()) == {"x": [1, 2]}
    source = fixed(b'{"y": 1}')
    assert source.next() is source.next()
    with pytest.raises(ValueError, match="not valid JSON"):
        fixed(b"{oops")


ALL_PLACEHOLDERS = {
    "i": "{{int:-3:3}}",
    "f": "{{float:0.5:1.5}}",
    "v": "{{floats:4:-1:1}}",
    "c": "{{choice:red|green|a:b}}",
    "w": "{{words:5}}",
    "p": "{{prompt}}",
    "u": "{{uuid}}",
    "nested": [{"deep": "{{ int:7:7 }}"}, "plain", 3, None, "{not a {placeholder}}"],
    "const": {"k": True},
}


def test_template_renders_every_placeholder_kind() -> None:
    source = TemplatePayloads(ALL_PLACEHOLDERS, seed=1, prompt_lengths=PromptLengths.parse("8"))
    for _ in range(200):
        body = json.loads(source.next())
        assert isinstance(body["i"], int) and -3 <= body["i"] <= 3
        assert isinstance(body["f"], float) and 0.5 <= body["f"] <= 1.5
        assert len(body["v"]) == 4 and all(-1 <= x <= 1 for x in body["v"])
        assert body["c"] in {"red", "green", "a:b"}
        assert len(body["w"].split(" ")) == 5 and set(body["w"].split()) <= set(WORDS)
        assert len(body["p"].split(" ")) == 8
        assert uuid.UUID(body["u"]).version == 4
        assert body["nested"] == [{"deep": 7}, "plain", 3, None, "{not a {placeholder}}"]
        assert body["const"] == {"k": True}


def test_template_from_string_is_compact_and_seeded() -> None:
    text = json.dumps({"x": "{{floats:3:0:1}}", "id": "{{uuid}}", "n": "{{int:0:1000000}}"})
    a = TemplatePayloads(text, seed=42)
    b = TemplatePayloads(text, seed=42)
    c = TemplatePayloads(text, seed=43)
    first = [a.next() for _ in range(5)]
    assert first == [b.next() for _ in range(5)]
    assert first != [c.next() for _ in range(5)]
    assert b" " not in first[0]
    assert len(set(first)) == 5


def test_template_draws_vary_between_calls() -> None:
    source = TemplatePayloads({"n": "{{int:0:1000000000}}"}, seed=0)
    assert len({source.next() for _ in range(20)}) == 20


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ({"x": "{{nope}}"}, "unknown placeholder"),
        ({"x": "{{intt:1:2}}"}, "unknown placeholder"),
        ({"x": "Say {{words:3}} now"}, "whole string value"),
        ({"x": "{{int:5:1}}"}, "must be >="),
        ({"x": "{{int:a:b}}"}, "invalid placeholder"),
        ({"x": "{{float:1}}"}, "LO:HI"),
        ({"x": "{{floats:0:0:1}}"}, "N must be >= 1"),
        ({"x": "{{choice:}}"}, "choice:a"),
        ({"x": "{{words}}"}, "expected N"),
        ({"x": "{{uuid:4}}"}, "no arguments"),
        ({"x": "{{prompt}}"}, "prompt_lengths"),
        ('{"x": ', "not valid JSON"),
    ],
)
def test_template_rejects_at_construction(template: str | dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        TemplatePayloads(template)


def test_template_root_placeholder() -> None:
    source = TemplatePayloads('"{{choice:only}}"')
    assert source.next() == b'"only"'


def test_prompt_lengths_fixed() -> None:
    lengths = PromptLengths.parse("32")
    rng = random.Random(0)
    assert {lengths.draw(rng) for _ in range(50)} == {32}
    assert str(lengths) == "32"


def test_prompt_lengths_uniform_within_bounds() -> None:
    lengths = PromptLengths.parse("uniform:16:20")
    rng = random.Random(0)
    draws = [lengths.draw(rng) for _ in range(2000)]
    assert set(draws) == {16, 17, 18, 19, 20}


def test_prompt_lengths_normal_clipped_to_one() -> None:
    rng = random.Random(0)
    wide = [PromptLengths.parse("normal:2:50").draw(rng) for _ in range(2000)]
    assert min(wide) == 1 and all(isinstance(n, int) for n in wide)
    centred = [PromptLengths.parse("normal:128:8").draw(rng) for _ in range(4000)]
    assert abs(sum(centred) / len(centred) - 128) < 1.5


@pytest.mark.parametrize(
    "text", ["0", "-4", "abc", "uniform:5", "uniform:9:3", "normal:1:-2", "zipf:1:2", ""]
)
def test_prompt_lengths_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid prompt length"):
        PromptLengths.parse(text)


def test_template_prompt_length_follows_distribution() -> None:
    source = TemplatePayloads(
        {"prompt": "{{prompt}}"}, seed=3, prompt_lengths=PromptLengths.parse("uniform:2:4")
    )
    lengths = {len(json.loads(source.next())["prompt"].split(" ")) for _ in range(200)}
    assert lengths == {2, 3, 4}


# --- report -------------------------------------------------------------------------------


def _rendered(table: Table) -> str:
    console = Console(width=200, record=True, file=None, force_terminal=False)
    with console.capture() as capture:
        console.print(table)
    return capture.get()


def _sweep() -> list[tuple[str, Summary]]:
    return [
        ("c=1", summarize(_stream_samples(), 4.0, {"ttft": 0.3})),
        ("c=2", summarize(_mixed_samples(), 2.0, {"latency": 0.25})),
    ]


def test_render_summary_shows_counts_errors_and_streams() -> None:
    summary = summarize(_mixed_samples() + _stream_samples(), 2.0, {"latency": 1.0})
    text = _rendered(render_summary(summary, "http://x c=8"))
    for needle in ("http://x c=8", "requests", "http_503: 2", "timeout: 1", "p99", "ttft ms"):
        assert needle in text
    assert "itl ms" in text and "tok/s" in text and "goodput" in text
    plain = _rendered(render_summary(summarize(_mixed_samples(), 2.0), "t"))
    assert "ttft" not in plain and "goodput" not in plain


def test_render_sweep_has_one_row_per_level() -> None:
    table = render_sweep(_sweep())
    assert table.row_count == 2
    headers = [column.header for column in table.columns]
    assert headers[:6] == ["level", "req/s", "success", "errors", "p50 ms", "p99 ms"]
    assert "ttft p99" in headers and "tok/s" in headers and "goodput/s" in headers
    text = _rendered(table)
    assert "c=1" in text and "c=2" in text


def test_write_json(tmp_path: Path) -> None:
    path = tmp_path / "out" / "result.json"
    payload = {"levels": [summarize(_mixed_samples(), 2.0).to_dict()], "path": tmp_path}
    write_json(path, payload)
    loaded = json.loads(path.read_text(encoding="utf-8"))
    assert loaded["levels"][0]["requests"] == 7
    assert loaded["path"] == str(tmp_path)
    assert list(path.parent.iterdir()) == [path]


def test_plots_write_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    sweep_png = tmp_path / "sweep.png"
    plot_sweep(_sweep(), sweep_png)
    assert sweep_png.read_bytes()[:8] == PNG_SIGNATURE
    samples = [*_mixed_samples(), Sample(3.0, 0.05, 200)]
    timeline_png = tmp_path / "timeline.png"
    plot_timeline(timeline(samples, bucket_s=0.5), timeline_png)
    assert timeline_png.read_bytes()[:8] == PNG_SIGNATURE


def test_plots_survive_degenerate_runs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    only_errors = summarize([Sample(0.0, 1.0, 0, "connect")], 1.0)
    plot_sweep([("c=1", only_errors)], tmp_path / "one.png")
    plot_timeline([], tmp_path / "empty.png")
    for name in ("one.png", "empty.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_SIGNATURE
