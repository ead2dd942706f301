"""Label-free input drift without sockets: the statistics on known distributions (the
p-values against SciPy's), profiles and counting, windows, the server's differencing of
replicas' counters, the registry's references, and the detection itself: a 2 sigma shift
of one feature crosses the PSI line within one window while unshifted streams stay under
it (the false-alarm rate measured over 200 windows)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import scipy.special
import scipy.stats

from inferd.config import DriftConfig
from inferd.control.drift import VersionDrift, write_drift
from inferd.errors import InvalidInput, ModelNotFound
from inferd.monitoring.drift_stats import (
    Counts,
    DriftWindow,
    chi2,
    chi2_sf,
    embedding_distances,
    kolmogorov_sf,
    ks,
    psi,
    scores,
)
from inferd.monitoring.exposition import Text
from inferd.registry import Registry
from inferd.shapes.drift import Profile, bins_of
from inferd.shapes.replica import DriftCounts
from inferd.shapes.tensors import Signature, TensorSpec
from inferd.telemetry.drift import (
    MAX_ROWS_COUNTED,
    REFERENCE_FILE,
    Binner,
    DriftCounter,
    build_profile,
    read_reference_sample,
)

TABULAR = Signature(
    (TensorSpec("features", "FP32", (-1, 4)), TensorSpec("country", "BYTES", (-1,))),
    (TensorSpec("prediction", "FP32", (-1,)),),
)
TEXTS = Signature(
    (TensorSpec("text", "BYTES", (-1,)),), (TensorSpec("embedding", "FP32", (-1, 64)),)
)
THRESHOLD = 0.2
WINDOW = 1000
REFERENCE = 1000


def rows(rng: np.random.Generator, n: int, shift: float = 0.0, feature: int = 2) -> dict:
    """``n`` rows of four standard normal features (``feature`` moved by ``shift``) and
    a country from three, as a replica receives them."""
    x = rng.normal(size=(n, 4)).astype(np.float32)
    x[:, feature] += shift
    country = rng.choice(np.array(["fr", "de", "it"], dtype=object), n, p=[0.5, 0.3, 0.2])
    return {"features": x, "country": country}


def window_of(profile: Profile, columns: dict) -> Counts:
    counts, sums, squares, n = Binner(profile.features, profile.projections).count(columns)
    return Counts(0.0, 1.0, n, counts, sums, squares)


# -- statistics -----------------------------------------------------------------------------


@pytest.mark.parametrize("x", [0.05, 0.2, 0.4, 0.7, 1.0, 1.36, 2.0, 3.5])
def test_kolmogorov_survival_is_scipys(x: float) -> None:
    assert kolmogorov_sf(x) == pytest.approx(scipy.special.kolmogorov(x), abs=1e-9)


@pytest.mark.parametrize(
    ("x", "dof"), [(0.5, 1), (3.0, 2), (10.0, 5), (100.0, 80), (50.0, 3), (300.0, 200), (1e-3, 9)]
)
def test_chi2_survival_is_scipys(x: float, dof: int) -> None:
    assert chi2_sf(x, dof) == pytest.approx(scipy.stats.chi2.sf(x, dof), rel=1e-9, abs=1e-300)


def test_psi_is_zero_for_equal_shares_and_grows_with_the_shift() -> None:
    reference = np.array([100, 200, 300, 400])
    assert psi(reference, reference * 3) == pytest.approx(0.0, abs=1e-5)  # smoothing aside
    # by hand: shares (smoothed by half a row) 0.1/0.4 swapped with 0.4/0.1
    moved = np.array([400, 200, 300, 100])
    r = (reference + 0.5) / (reference + 0.5).sum()
    w = (moved + 0.5) / (moved + 0.5).sum()
    assert psi(reference, moved) == pytest.approx(float(np.sum((w - r) * np.log(w / r))))
    assert psi(reference, moved) > 0.8
    # a bin empty on one side stays finite; bins empty on both sides count nothing
    assert np.isfinite(psi(np.array([10, 0, 5]), np.array([0, 10, 5])))
    assert psi(np.array([10, 0, 5]), np.array([20, 0, 10])) == pytest.approx(0.0, abs=1e-3)


def test_binned_ks_is_the_largest_cdf_gap_and_chi2_is_scipys() -> None:
    reference, window = np.array([50, 30, 20]), np.array([20, 30, 50])
    statistic, p_value = ks(reference, window)
    assert statistic == pytest.approx(0.3)  # cumulative 0.5/0.8 against 0.2/0.5
    exact = scipy.stats.ks_2samp(
        np.repeat([0, 1, 2], reference), np.repeat([0, 1, 2], window), method="asymp"
    )
    assert statistic == pytest.approx(exact.statistic)
    assert 0 < p_value < 1e-3
    statistic, p_value = chi2(reference, window)
    expected = scipy.stats.chi2_contingency(np.vstack([reference, window]), correction=False)
    assert statistic == pytest.approx(expected.statistic)
    assert p_value == pytest.approx(expected.pvalue)


# -- profiles and counting -----------------------------------------------------------------


def test_a_profile_has_deciles_flag_bins_categories_and_text_lengths() -> None:
    rng = np.random.default_rng(0)
    signature = Signature(
        (
            TensorSpec("x", "FP64", (-1, 2)),
            TensorSpec("flag", "BOOL", (-1,)),
            TensorSpec("country", "BYTES", (-1,)),
            TensorSpec("text", "BYTES", (-1,)),
            TensorSpec("image", "FP32", (-1, 4, 4)),
        ),
        (TensorSpec("y", "FP32", (-1,)),),
    )
    n = 2000
    columns = {
        "x": rng.normal(size=(n, 2)),
        "flag": rng.random(n) < 0.3,
        "country": np.array(["fr", "de"] * (n // 2), dtype=object),
        "text": np.array(["w" * int(k) for k in rng.integers(1, 300, n)], dtype=object),
        "image": rng.random((n, 4, 4)),
    }
    profile = build_profile(signature, columns, "sample", {"features": ["age", "income"]})
    by_name = {f.name: f for f in profile.features}
    assert list(by_name) == ["age", "income", "flag", "country", "text.length"]  # no image
    age = by_name["age"]
    assert len(age.edges) == 9 and age.counts[:-1] == [200] * 10 and age.counts[-1] == 0
    assert by_name["flag"].edges == [0.5] and sum(by_name["flag"].counts) == n
    assert by_name["country"].categories == ["de", "fr"] and by_name["country"].counts == [
        1000,
        1000,
        0,
    ]
    assert by_name["text.length"].kind == "numeric" and by_name["text.length"].length
    assert profile.rows == n and len(profile.digest) == 16
    # the digest names the bins, not the counts: the same layout, other rows, same digest
    again = build_profile(signature, {**columns, "flag": ~columns["flag"]}, "sample", {})
    assert again.digest != profile.digest  # other names (x[0], x[1]) are another layout
    assert Profile.from_dict(profile.to_dict()) == profile


def test_counting_matches_a_plain_searchsorted_with_nan_other_and_bytes() -> None:
    rng = np.random.default_rng(1)
    profile = build_profile(TABULAR, rows(rng, REFERENCE), "sample")
    batch = rows(rng, 300)
    batch["features"][:7, 1] = np.nan
    batch["country"][:5] = b"fr"  # BYTES may arrive as bytes
    batch["country"][5:9] = "es"  # unseen: the "other" bin
    counts, sums, squares, n = Binner(profile.features).count(batch)
    assert n == 300
    start = 0
    for i, feature in enumerate(profile.features):
        mine = counts[start : start + bins_of(feature)]
        start += bins_of(feature)
        if feature.kind == "numeric":
            x = batch["features"][:, feature.column].astype(np.float64)
            finite = x[~np.isnan(x)]
            expected = np.bincount(
                np.searchsorted(feature.edges, finite, side="right"), minlength=len(mine) - 1
            )
            assert mine[:-1].tolist() == expected.tolist()
            assert mine[-1] == np.isnan(x).sum()
            assert sums[i] == pytest.approx(finite.sum())
            assert squares[i] == pytest.approx((finite**2).sum())
        else:
            values = [v.decode() if isinstance(v, bytes) else v for v in batch["country"]]
            assert mine[-1] == 4  # "es"
            for k, category in enumerate(feature.categories):
                assert mine[k] == values.count(category)


def test_a_batch_larger_than_the_cap_is_counted_by_a_stride() -> None:
    rng = np.random.default_rng(2)
    profile = build_profile(TABULAR, rows(rng, REFERENCE), "sample")
    counts, _, _, n = Binner(profile.features).count(rows(rng, 3 * MAX_ROWS_COUNTED))
    assert n == MAX_ROWS_COUNTED
    assert counts[: bins_of(profile.features[0])].sum() == MAX_ROWS_COUNTED


def test_a_registered_sample_is_read_and_checked(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    assert read_reference_sample(tmp_path, TABULAR) is None
    sample = rows(rng, 500)
    np.savez(tmp_path / REFERENCE_FILE, features=sample["features"], country=["fr"] * 500)
    found = read_reference_sample(tmp_path, TABULAR)
    assert found is not None and found["features"].shape == (500, 4)
    assert found["country"].dtype == object
    for bad, message in [
        ({"feature": sample["features"]}, "must be named by the inputs"),
        ({"features": sample["features"][:, 0]}, "the input is FP32 [-1, 4]"),
        ({"features": sample["features"][:50]}, "50 rows; a reference needs 100+"),
        ({"features": sample["features"], "country": ["fr"] * 499}, "different numbers of rows"),
    ]:
        np.savez(tmp_path / REFERENCE_FILE, **bad)
        with pytest.raises(ValueError, match=re.escape(message)):
            read_reference_sample(tmp_path, TABULAR)
    (tmp_path / REFERENCE_FILE).write_bytes(b"not a zip")
    with pytest.raises(ValueError, match=r"not a numpy \.npz"):
        read_reference_sample(tmp_path, TABULAR)


def test_a_replica_counts_nothing_until_asked_then_builds_and_hands_over_a_profile() -> None:
    rng = np.random.default_rng(4)
    counter = DriftCounter(TABULAR, {})
    counter.observe(rows(rng, 500))  # warm-up, or a server with drift off: not counted
    assert counter.report()["collected"] == 0
    counter.configure(None, reference_rows=300, max_categories=50)
    counter.observe(rows(rng, 200))
    assert counter.report()["collected"] == 200 and counter.report()["digest"] == ""
    counter.observe(rows(rng, 150))  # 100 of these complete the reference
    report = counter.report()
    assert report["digest"] and report["rows"] == 0 and report["profile"].rows == 300
    counter.observe(rows(rng, 40))
    assert counter.report()["rows"] == 40
    own = report["profile"]
    counter.configure(own, 300, 50)  # the server adopted it: acknowledged, counts kept
    assert counter.report()["profile"] is None and counter.report()["rows"] == 40
    other = build_profile(TABULAR, rows(rng, 400, shift=1.0), "requests")
    since = counter.since
    counter.configure(other, 300, 50)  # another replica's came first: count on that one
    report = counter.report()
    assert report["digest"] == other.digest and report["rows"] == 0
    assert counter.since >= since and report["profile"] is None


def test_past_its_rate_a_replica_counts_one_row_in_k_and_in_bulk() -> None:
    rng = np.random.default_rng(10)
    now = [0.0]
    counter = DriftCounter(TABULAR, {}, clock=lambda: now[0])
    profile = build_profile(TABULAR, rows(rng, REFERENCE), "sample")
    counter.configure(profile, 1000, 50, max_rows_per_s=100)
    for _ in range(100):  # 1,000 rows in the first second: all counted
        counter.observe(rows(rng, 10))
    assert counter.report()["rows"] == 1000
    now[0] = 1.0  # that second's rate: 1,000 rows/s, ten times the cap
    for _ in range(500):  # one-row batches: every tenth row, across batches
        counter.observe(rows(rng, 1))
    assert counter._pending_rows == 50  # kept, not counted yet: counted in bulk
    report = counter.report()
    assert report["rows"] == 1050 and report["seen"] == 1500
    assert sum(report["counts"][: bins_of(profile.features[0])]) == 1050


# -- embeddings -----------------------------------------------------------------------------

TOPICS = np.random.default_rng(100).normal(size=(4, 64))
"""Four topics' directions in a 64-dimensional embedding space; the reference has the
first three."""


def embedded(rng: np.random.Generator, n: int, topics: list[float]) -> dict:
    """``n`` texts of 5-14 words and their unit embeddings: a topic's direction (drawn
    with the shares ``topics``) plus noise as large."""
    topic = rng.choice(len(topics), n, p=topics)
    x = TOPICS[topic] + rng.normal(size=(n, 64))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    words = rng.integers(5, 15, n)
    text = np.array([" ".join(f"w{i}" for i in rng.integers(0, 9, k)) for k in words], dtype=object)
    return {"text": text, "embedding": x.astype(np.float32)}


SAME, NEW_TOPIC = [0.5, 0.3, 0.2, 0.0], [0.35, 0.21, 0.14, 0.3]


def test_an_embedding_is_counted_on_its_principal_directions_and_a_new_topic_is_flagged() -> None:
    """A text embedding model's reference: its texts' lengths, and its embeddings' mean
    and top 8 directions. Windows of the same topics raise no alarm (100 windows) and
    keep the embedding's distance small; 30 % of a fourth topic moves the embedding's
    features, and its distance by several standard deviations, while the texts'
    lengths (unchanged) stay quiet."""
    rng = np.random.default_rng(11)
    profile = build_profile(TEXTS, embedded(rng, REFERENCE, [*SAME[:3], 0.0]), "sample")
    (projection,) = profile.projections
    assert projection.tensor == "embedding" and projection.output
    assert len(projection.directions) == 8 and len(projection.center) == 64
    w = np.asarray(projection.directions)
    np.testing.assert_allclose(w @ w.T, np.eye(8), atol=1e-9)  # orthonormal
    names = [f.name for f in profile.features]
    assert names == [
        "text.length",
        *(f"embedding.pc{k}" for k in range(1, 9)),
        "embedding.residual",
        "embedding.cosine",
    ]
    alarms, distances = 0, []
    for _ in range(100):
        found = scores(profile, window_of(profile, embedded(rng, WINDOW, SAME)), THRESHOLD)
        alarms += any(e["drifted"] for e in found)
        distances.append(embedding_distances(profile, found)[0]["distance"])
    assert alarms <= 1, f"false alarms in {alarms} of 100 windows"
    assert max(distances) < 0.4  # ~sqrt(8 / 1000) = 0.09 expected
    found = scores(profile, window_of(profile, embedded(rng, WINDOW, NEW_TOPIC)), THRESHOLD)
    drifted = [e["name"] for e in found if e["drifted"]]
    assert drifted and all(name.startswith("embedding.") for name in drifted)
    (summary,) = embedding_distances(profile, found)
    assert summary["name"] == "embedding" and summary["drifted"] == sorted(
        drifted, key=lambda n: [e["name"] for e in found].index(n)
    )
    assert summary["distance"] > 1.0, summary


def test_a_replica_profiles_its_embeddings_from_its_first_requests() -> None:
    """Inputs are counted before the batch, outputs after it: the replica's own profile
    waits for both, then counts both (the rows once)."""
    rng = np.random.default_rng(12)
    counter = DriftCounter(TEXTS, {})
    assert counter.outputs == ["embedding"]
    counter.configure(None, reference_rows=300, max_categories=50)
    for _ in range(3):
        batch = embedded(rng, 100, SAME)
        counter.observe({"text": batch["text"]})
        assert counter.report()["digest"] == ""  # the third's inputs: its outputs next
        counter.observe_outputs({"embedding": batch["embedding"]})
    report = counter.report()
    profile = report["profile"]
    assert profile.rows == 300 and profile.projections[0].tensor == "embedding"
    assert report["rows"] == 0
    batch = embedded(rng, 40, SAME)
    counter.observe({"text": batch["text"]})
    counter.observe_outputs(batch)  # other outputs are not kept
    report = counter.report()
    assert report["rows"] == 40
    start = 0
    for feature in profile.features:
        end = start + bins_of(feature)
        assert sum(report["counts"][start:end]) == 40, feature.name
        start = end
    metadata = {"drift_embeddings": ["vector"]}  # named by metadata: "embedding" is not
    assert DriftCounter(TEXTS, metadata).outputs == []


def test_a_sample_may_carry_the_embeddings_and_a_wide_input_is_an_embedding(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(13)
    batch = embedded(rng, 200, SAME)
    np.savez(
        tmp_path / REFERENCE_FILE, text=batch["text"].astype(str), embedding=batch["embedding"]
    )
    found = read_reference_sample(tmp_path, TEXTS)
    assert found is not None and found["embedding"].shape == (200, 64)
    assert build_profile(TEXTS, found, "sample").projections[0].output
    np.savez(tmp_path / REFERENCE_FILE, text=batch["text"].astype(str), vector=batch["embedding"])
    with pytest.raises(
        ValueError, match=r"inputs \(and embedding outputs\) \['embedding', 'text'\]"
    ):
        read_reference_sample(tmp_path, TEXTS)
    wide = Signature((TensorSpec("x", "FP32", (-1, 300)),), (TensorSpec("y", "FP32", (-1,)),))
    x = rng.normal(size=(500, 300))
    profile = build_profile(wide, {"x": x}, "sample")
    assert [p.tensor for p in profile.projections] == ["x"] and not profile.projections[0].output
    assert len(profile.features) == 10  # 8 directions, residual, cosine: not 300 columns
    counts, _, _, n = Binner(profile.features, profile.projections).count({"x": x[:50]})
    assert n == 50 and counts.sum() == 10 * 50


# -- windows and the server's differencing ------------------------------------------------


def counts_of(rows_: int, until: float, size: int = 3) -> Counts:
    return Counts(until - 1, until, rows_, np.full(size, rows_), np.zeros(1), np.zeros(1))


def test_a_window_holds_the_newest_looks_that_reach_its_rows_and_none_too_old() -> None:
    window = DriftWindow()
    for t in range(1, 11):
        window.add(counts_of(100, float(t)))
    window.add(counts_of(0, 11.0))  # an empty look adds nothing
    current = window.current(10.0, rows=250, max_age_s=100)
    assert current is not None and current.rows == 300 and current.since == 7.0
    assert len(window.looks) == 3  # what no later window needs is forgotten
    current = window.current(14.5, rows=250, max_age_s=5)
    assert current is not None and current.rows == 100  # only the look ending at 10
    assert window.current(100.0, rows=250, max_age_s=5) is None


def reply(since: float, age_s: float, rows_: int, digest: str) -> DriftCounts:
    return DriftCounts(0, digest, since, age_s, rows_, [rows_, 0, 0], [0.0], [0.0])


def test_replicas_counters_are_differenced_and_a_new_one_counts_only_if_it_is_new() -> None:
    rng = np.random.default_rng(5)
    state = VersionDrift("m", "v1", THRESHOLD)
    state.reference = build_profile(TABULAR, rows(rng, REFERENCE), "sample")
    digest = state.reference.digest
    state.looked_at = 1000.0
    # counting since long before this monitor's last look (a restarted server): baseline
    assert state.take("r0", reply(10.0, 990.0, 5000, digest), 1010.0) is None
    assert state.take("r0", reply(10.0, 1000.0, 5300, digest), 1020.0).rows == 300  # type: ignore[union-attr]
    # a replica that began after the last look: all it counted
    assert state.take("r1", reply(1005.0, 5.0, 80, digest), 1010.0).rows == 80  # type: ignore[union-attr]
    # restarted since the last look (another counter): all it counted since; counts on
    # another profile: nothing
    assert state.take("r1", reply(1012.0, 3.0, 10, digest), 1015.0).rows == 10  # type: ignore[union-attr]
    assert state.take("r2", reply(1005.0, 1.0, 10, "other"), 1010.0) is None
    config = DriftConfig()
    assert state.query("r2", config).reference == state.reference
    assert state.query("r0", config).reference is None  # it counts on it already


# -- detection ----------------------------------------------------------------------------


def test_unshifted_windows_raise_no_false_alarm_and_a_2_sigma_shift_is_flagged() -> None:
    """The false-alarm rate over 200 windows of 1,000 rows (5 features each: 1,000 tests)
    is at most 1 % (it is 0: an unshifted window's largest PSI is ~0.05 against 0.2), and
    one feature moved by 2 sigma is flagged, alone, in the first window it fills."""
    rng = np.random.default_rng(6)
    profile = build_profile(TABULAR, rows(rng, REFERENCE), "sample")
    alarms, largest = 0, 0.0
    for _ in range(200):
        found = scores(profile, window_of(profile, rows(rng, WINDOW)), THRESHOLD)
        alarms += any(e["drifted"] for e in found)
        largest = max(largest, found[0]["psi"])
    assert alarms / 200 <= 0.01, f"false-alarm rate {alarms / 200:.1%}"
    assert largest < THRESHOLD / 2
    found = scores(profile, window_of(profile, rows(rng, WINDOW, shift=2.0)), THRESHOLD)
    assert [e["name"] for e in found if e["drifted"]] == ["features[2]"]
    top = found[0]
    assert top["name"] == "features[2]" and top["psi"] > 10 * THRESHOLD
    assert top["mean_shift_sigma"] == pytest.approx(2.0, abs=0.15)
    assert top["ks"] > 0.5 and top["ks_p_value"] < 1e-6


def test_a_shift_mid_stream_is_flagged_before_the_window_has_turned_over() -> None:
    """Looks of 100 rows into a 1,000-row window: the shifted feature crosses the line
    once a share of the window has moved, well before all of it has."""
    rng = np.random.default_rng(7)
    profile = build_profile(TABULAR, rows(rng, REFERENCE), "sample")
    window = DriftWindow()
    for t in range(10):
        window.add(_at(window_of(profile, rows(rng, 100)), float(t + 1)))
    assert not any(e["drifted"] for e in _scored(profile, window, 10.0))
    for look in range(1, 11):
        window.add(_at(window_of(profile, rows(rng, 100, shift=2.0)), 10.0 + look))
        if any(e["drifted"] for e in _scored(profile, window, 10.0 + look)):
            break
    assert look <= 5, "not flagged with half the window shifted"
    assert _scored(profile, window, 10.0 + look)[0]["name"] == "features[2]"


def _at(counts: Counts, t: float) -> Counts:
    counts.since, counts.until = t - 1, t
    return counts


def _scored(profile: Profile, window: DriftWindow, now: float) -> list[dict]:
    current = window.current(now, WINDOW, 3600)
    assert current is not None
    return scores(profile, current, THRESHOLD)


def test_metrics_name_each_feature_and_its_threshold() -> None:
    rng = np.random.default_rng(8)
    state = VersionDrift("fraud", "v1", THRESHOLD)
    state.reference = build_profile(TABULAR, rows(rng, REFERENCE), "sample")
    state.current = window_of(state.reference, rows(rng, WINDOW, shift=2.0))
    state.scores = scores(state.reference, state.current, THRESHOLD)
    out = Text()
    write_drift(out, [state])
    text = out.render()
    assert 'inferd_drift_features_drifted{model="fraud",version="v1"} 1' in text
    assert 'inferd_drift_window_rows{model="fraud",version="v1"} 1000' in text
    line = 'inferd_drift_psi_threshold{model="fraud",version="v1",feature="features[2]"} 0.2'
    assert line in text
    assert 'inferd_drift_p_value{model="fraud",version="v1",feature="country",test="chi2"}' in text
    assert 'inferd_drift_ks{model="fraud",version="v1",feature="country"}' not in text


# -- the registry ---------------------------------------------------------------------------


def test_a_pushed_sample_becomes_the_reference_and_goes_with_its_version(
    registry: Registry, tmp_path: Path
) -> None:
    rng = np.random.default_rng(9)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.bin").write_bytes(b"x")
    np.savez(folder / REFERENCE_FILE, features=rows(rng, 300)["features"])
    registry.push("m", folder, "v1", framework="sklearn", signature=TABULAR)
    found = registry.drift_references.get("m", "v1")
    assert found is not None and found["source"] == "sample" and found["rows"] == 300
    assert [f["name"] for f in found["features"]] == [f"features[{j}]" for j in range(4)]
    np.savez(folder / REFERENCE_FILE, features=rows(rng, 300)["features"][:, :2])
    with pytest.raises(InvalidInput, match=r"drift_reference\.npz"):
        registry.push("m", folder, "v2", framework="sklearn", signature=TABULAR)
    (folder / REFERENCE_FILE).unlink()
    registry.push("m", folder, "v2", framework="sklearn", signature=TABULAR)
    assert registry.drift_references.get("m", "v2") is None
    first = build_profile(TABULAR, rows(rng, 200), "requests").to_dict()
    second = build_profile(TABULAR, rows(rng, 200, shift=1.0), "requests").to_dict()
    assert registry.drift_references.keep("m", "v2", first) == first
    assert registry.drift_references.keep("m", "v2", second) == first  # the first stays
    registry.delete_version("m", "v2")  # its reference goes with it
    with pytest.raises(ModelNotFound):
        registry.drift_references.get("m", "v2")
    registry.push("m", folder, "v2", framework="sklearn", signature=TABULAR)
    assert registry.drift_references.get("m", "v2") is None  # not the deleted one's
