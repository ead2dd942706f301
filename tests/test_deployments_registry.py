"""Deployments and traffic splits in the registry, against SQLite files and PostgreSQL.

Every test runs on both backends (fixtures as in test_registry.py). The rules under
test are the ones at the top of :mod:`inferd.registry.deployments`: automatic mode
until the first deployment, splits that always sum to 100, an audit row per change,
optimistic concurrency through ``revision``, and removal in two steps.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from inferd import devices
from inferd.errors import Conflict, InferdError, InvalidInput, ModelNotFound
from inferd.registry import Registry
from inferd.registry.deployments import TrafficRecord
from inferd.shapes.tensors import Signature, TensorSpec
from tests.conftest import fake_gpus

SIGNATURE = Signature(
    inputs=(TensorSpec("x", "FP32", (-1,)),),
    outputs=(TensorSpec("prediction", "FP32", (-1,)),),
)


# -- fixtures ----------------------------------------------------------------------------


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "model.py"
    path.parent.mkdir()
    path.write_text("class M:\n    pass\n")
    return path


def push(reg: Registry, source: Path, model: str, *versions: str) -> None:
    """Register ``versions`` of ``model``, oldest first, each taking all the traffic
    (``--deploy``): the model stays in automatic mode, its newest version serving."""
    for version in versions:
        reg.push(model, source, version, framework="python", signature=SIGNATURE, deploy=True)


def split(reg: Registry, model: str) -> dict[str, int]:
    return {d.version: d.traffic_pct for d in reg.deployments.list_all(model)}


def statuses(reg: Registry, model: str) -> dict[str, str]:
    return {d.version: d.status for d in reg.deployments.list_all(model)}


# -- deploy ----------------------------------------------------------------------------


@pytest.fixture
def a100(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process sees one A100 (a stand-in ``nvidia-smi`` first on PATH)."""
    monkeypatch.setenv("PATH", fake_gpus(tmp_path / "bin", "NVIDIA A100-SXM4-80GB")["PATH"])
    devices.local_gpus.cache_clear()
    yield
    devices.local_gpus.cache_clear()


def test_a_gpu_this_machine_lacks_is_refused(registry: Registry, source: Path) -> None:
    push(registry, source, "fraud", "v1")
    devices.local_gpus.cache_clear()
    if devices.local_gpus():
        pytest.skip("this machine has a GPU")
    with pytest.raises(InvalidInput, match=r"'A100' cannot be honoured.*has no GPU"):
        registry.deployments.deploy("fraud", "v1", gpu_type="A100", actor="alice")
    assert registry.deployments.list_all() == []  # nothing recorded


def test_registering_is_not_deploying(registry: Registry, source: Path) -> None:
    """The design documents' flow: register v2 while v1 serves, then give it 10 %."""

    def register(version: str, deploy: bool = False) -> None:
        registry.push(
            "fraud", source, version, framework="python", signature=SIGNATURE, deploy=deploy
        )

    register("v1")  # the first version of a new model serves at once: automatic mode
    assert registry.deployments.list_all("fraud") == []
    register("v2")
    assert split(registry, "fraud") == {"v1": 100}
    (change,) = registry.deployments.history("fraud")
    assert (change.reason, change.actor) == ("deploy", "cli")
    assert change.detail == "v2 registered; v1 keeps serving"
    registry.deployments.deploy("fraud", "v2", traffic_pct=10, actor="alice")
    assert split(registry, "fraud") == {"v2": 10, "v1": 90}
    register("v3")  # deployments decide: a new version changes nothing
    assert split(registry, "fraud") == {"v2": 10, "v1": 90}
    register("v4", deploy=True)  # --deploy: a rolling deployment at 100 %
    assert split(registry, "fraud") == {"v4": 100, "v2": 0, "v1": 0}
    assert registry.deployments.history("fraud")[0].detail == "deployed v4"


def test_first_deploy_adopts_the_newest_version(
    registry: Registry, source: Path, a100: None
) -> None:
    push(registry, source, "fraud", "v1", "v2")  # automatic mode serves v2
    assert registry.deployments.list_all() == [] and registry.deployments.revision("fraud") == 0
    with pytest.raises(InvalidInput, match=r"'H100' cannot be honoured.*0: NVIDIA A100"):
        registry.deployments.deploy("fraud", "v1", gpu_type="H100", actor="alice")

    record = registry.deployments.deploy(
        "fraud", "v1", traffic_pct=10, replicas=2, gpu_type="A100", actor="alice"
    )

    assert (record.model_name, record.version, record.status) == ("fraud", "v1", "deploying")
    assert (record.traffic_pct, record.replicas, record.gpu_type) == (10, 2, "A100")
    assert record.strategy == "rolling" and record.to_dict()["created_at"]
    assert split(registry, "fraud") == {"v2": 90, "v1": 10}  # newest version first
    adopted = registry.deployments.list_all("fraud")[0]
    assert (adopted.version, adopted.replicas, adopted.gpu_type) == ("v2", None, None)
    history = registry.deployments.history("fraud")
    assert [(h.split, h.reason, h.actor) for h in history] == [
        ({"v2": 90, "v1": 10}, "deploy", "alice"),
        ({"v2": 100}, "deploy", "inferd"),
    ]
    assert registry.deployments.revision("fraud") == history[0].revision


def test_deploy_at_100_keeps_the_old_version_at_0(registry: Registry, source: Path) -> None:
    push(registry, source, "fraud", "v1", "v2")
    registry.deployments.deploy("fraud", "v1", traffic_pct=100)
    assert split(registry, "fraud") == {"v2": 0, "v1": 100}
    assert statuses(registry, "fraud") == {"v2": "deploying", "v1": "deploying"}


def test_deploying_the_newest_first_adopts_nothing(registry: Registry, source: Path) -> None:
    push(registry, source, "fraud", "v1", "v2")
    with pytest.raises(InvalidInput, match="no other version taking traffic"):
        registry.deployments.deploy("fraud", "v2", traffic_pct=10)
    assert registry.deployments.list_all("fraud") == []
    registry.deployments.deploy("fraud", "v2", traffic_pct=100)
    assert split(registry, "fraud") == {"v2": 100}
    assert len(registry.deployments.history("fraud")) == 1


def test_deploying_scales_the_others_in_proportion(registry: Registry, source: Path) -> None:
    push(registry, source, "m", "v1", "v2", "v3", "v4")
    deploy = registry.deployments.deploy
    deploy("m", "v4", traffic_pct=100)
    deploy("m", "v3", traffic_pct=50)
    assert split(registry, "m") == {"v4": 50, "v3": 50}
    deploy("m", "v2", traffic_pct=10)
    assert split(registry, "m") == {"v4": 45, "v3": 45, "v2": 10}
    deploy("m", "v1", traffic_pct=25)  # 75 over 45:45:10 -> 33.75, 33.75, 7.5
    assert split(registry, "m") == {"v4": 34, "v3": 34, "v2": 7, "v1": 25}
    assert [sum(h.split.values()) for h in registry.deployments.history("m")] == [100] * 4


def test_deploy_at_0_adds_a_warm_version(registry: Registry, source: Path) -> None:
    push(registry, source, "m", "v1", "v2")
    registry.deployments.deploy("m", "v2", traffic_pct=100)
    registry.deployments.deploy("m", "v1", traffic_pct=0)
    assert split(registry, "m") == {"v2": 100, "v1": 0}


def test_deploying_a_deployed_version_conflicts(registry: Registry, source: Path) -> None:
    push(registry, source, "m", "v1", "v2")
    registry.deployments.deploy("m", "v1", traffic_pct=10)
    revision = registry.deployments.revision("m")
    for version in ("v1", "v2"):  # v2 was adopted: deployed as well
        with pytest.raises(Conflict, match=f"{version!r} of 'm' is already deployed") as info:
            registry.deployments.deploy("m", version, traffic_pct=50)
        assert info.value.status_code == 409
    assert registry.deployments.revision("m") == revision
    assert split(registry, "m") == {"v2": 90, "v1": 10}


def test_unknown_model_or_version_is_not_found(registry: Registry, source: Path) -> None:
    push(registry, source, "m", "v1")
    with pytest.raises(ModelNotFound, match="model 'nope' not found"):
        registry.deployments.deploy("nope", "v1", traffic_pct=100)
    with pytest.raises(ModelNotFound, match="version 'v9' of model 'm' is not registered") as info:
        registry.deployments.deploy("m", "v9", traffic_pct=100)
    assert info.value.status_code == 404
    assert registry.deployments.list_all() == [] and registry.deployments.history("m") == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"traffic_pct": -1}, "traffic_percent must be from 0 to 100"),
        ({"traffic_pct": 101}, "traffic_percent must be from 0 to 100"),
        ({"traffic_pct": "10"}, "traffic_percent must be an integer"),
        ({"traffic_pct": 10.5}, "traffic_percent must be an integer"),
        ({"traffic_pct": True}, "traffic_percent must be an integer"),
        ({"traffic_pct": 100, "replicas": 0}, "replicas must be an integer >= 1"),
        ({"traffic_pct": 100, "replicas": -2}, "replicas must be an integer >= 1"),
        ({"traffic_pct": 100, "replicas": "2"}, "replicas must be an integer >= 1"),
        ({"traffic_pct": 100, "replicas": True}, "replicas must be an integer >= 1"),
        ({"traffic_pct": 100, "replicas": 65}, "replicas must be at most 64"),
        ({"traffic_pct": 100, "gpu_type": "A" * 65}, "gpu must be a GPU type name"),
        ({"traffic_pct": 100, "gpu_type": ""}, "gpu must be a GPU type name"),
        ({"traffic_pct": 100, "gpu_type": 100}, "gpu must be a GPU type name"),
        ({"traffic_pct": 100, "strategy": "magic"}, "strategy 'magic' is not available"),
        ({"traffic_pct": 100, "strategy": "canary"}, "a canary starts below 100"),
        (
            {"traffic_pct": 5, "strategy": "canary", "rollout": {"steps": [1, 50, 100]}},
            "first step",
        ),
        ({"strategy": "canary", "rollout": {"steps": [10, 5, 100]}}, "steps must be increasing"),
        ({"strategy": "canary", "rollout": {"steps": [10, 50]}}, "ending at 100"),
        ({"strategy": "canary", "rollout": {"step_s": 0}}, "step_s must be seconds from 1"),
        ({"strategy": "canary", "rollout": {"min_requests": 0}}, "min_requests must be"),
        ({"strategy": "canary", "rollout": {"latency": "p99"}}, "latency must be 'compute'"),
        ({"strategy": "canary", "rollout": {"quantile": 99}}, "quantile must be between"),
        ({"strategy": "canary", "rollout": {"webhook": "ftp://x"}}, "webhook must be an http"),
        ({"strategy": "canary", "rollout": {"steps_s": 5}}, "unknown canary rollout setting"),
        ({"strategy": "canary", "rollout": {"max_error_rate_increase": 2}}, "from 0 to 1"),
        ({"strategy": "canary", "rollout": {"min_latency_increase_ms": -1}}, "min_latency"),
        ({"traffic_pct": 0, "strategy": "shadow"}, "a shadow mirrors traffic_percent 1 to 100"),
        ({"strategy": "shadow", "rollout": {"tolerance": -1}}, "tolerance must be a number"),
        ({"traffic_pct": 100, "fallback": "no"}, "fallback must be true or false"),
        ({"traffic_pct": 10, "strategy": "blue-green"}, "traffic_percent must be 100"),
        (
            {"traffic_pct": 100, "strategy": "blue-green", "rollout": {"keep": 1}},
            "unknown blue-green rollout setting",
        ),
        (
            {"traffic_pct": 100, "strategy": "blue-green", "rollout": {"keep_old_s": -1}},
            "keep_old_s must be seconds",
        ),
        ({"traffic_pct": 100, "rollout": {"keep_old_s": 5}}, "takes no rollout settings"),
        ({"traffic_pct": 100, "batching": {"max_batch": 4}}, "unknown batching keys"),
    ],
)
def test_bad_deploy_arguments_are_refused(
    registry: Registry, source: Path, kwargs: dict[str, Any], message: str
) -> None:
    push(registry, source, "m", "v1", "v2")
    with pytest.raises(InvalidInput, match=message) as info:
        registry.deployments.deploy("m", "v1", **kwargs)
    assert info.value.status_code == 422
    assert registry.deployments.list_all() == [] and registry.deployments.history("m") == []


# -- traffic ---------------------------------------------------------------------------


@pytest.fixture
def deployed(registry: Registry, source: Path) -> Registry:
    """Model "m" with v1, v2, v3 deployed, v3 (newest) taking all traffic."""
    push(registry, source, "m", "v1", "v2", "v3")
    registry.deployments.deploy("m", "v3", traffic_pct=100)
    registry.deployments.deploy("m", "v2", traffic_pct=0)
    registry.deployments.deploy("m", "v1", traffic_pct=0)
    return registry


def test_set_traffic_sets_the_whole_split(deployed: Registry) -> None:
    change = deployed.deployments.set_traffic(
        "m", {"v2": 60, "v1": 40}, actor="bob", detail="A/B test"
    )
    assert isinstance(change, TrafficRecord)
    assert change.split == {"v3": 0, "v2": 60, "v1": 40}  # left out: 0
    assert (change.reason, change.actor, change.detail) == ("manual", "bob", "A/B test")
    assert split(deployed, "m") == change.split
    assert deployed.deployments.revision("m") == change.revision


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        ({"v3": 60, "v2": 30}, InvalidInput, "must sum to 100; these sum to 90"),
        ({"v3": 110, "v2": -10}, InvalidInput, "integer percent from 0 to 100"),
        ({"v3": 50.0, "v2": 50}, InvalidInput, "integer percent from 0 to 100"),
        ({"v3": "50", "v2": 50}, InvalidInput, "integer percent from 0 to 100"),
        ({}, InvalidInput, "traffic must be an object"),
        ([["v3", 100]], InvalidInput, "traffic must be an object"),
        ({"v3": 50, "v9": 50}, ModelNotFound, r"\['v9'\] of 'm' are not deployed"),
    ],
)
def test_bad_splits_are_refused(
    deployed: Registry, bad: Any, error: type[InferdError], message: str
) -> None:
    before = deployed.deployments.history("m")
    with pytest.raises(error, match=message):
        deployed.deployments.set_traffic("m", bad)
    assert deployed.deployments.history("m") == before
    assert split(deployed, "m") == {"v3": 100, "v2": 0, "v1": 0}


def test_registered_but_undeployed_version_gets_no_traffic(
    registry: Registry, source: Path
) -> None:
    push(registry, source, "m", "v1", "v2")
    registry.deployments.deploy("m", "v2", traffic_pct=100)
    with pytest.raises(ModelNotFound, match=r"\['v1'\] of 'm' are not deployed"):
        registry.deployments.set_traffic("m", {"v1": 100})
    with pytest.raises(ModelNotFound, match="model 'nope' not found"):
        registry.deployments.set_traffic("nope", {"v1": 100})


def test_a_draining_version_takes_no_traffic(deployed: Registry) -> None:
    deployed.deployments.undeploy("m", "v1")
    with pytest.raises(InvalidInput, match=r"\['v1'\] take no traffic \(being removed"):
        deployed.deployments.set_traffic("m", {"v3": 50, "v1": 50})
    deployed.deployments.set_traffic("m", {"v3": 50, "v2": 50, "v1": 0})  # 0 is fine
    assert split(deployed, "m") == {"v3": 50, "v2": 50, "v1": 0}


def test_history_records_every_change_newest_first(deployed: Registry) -> None:
    d = deployed.deployments
    d.set_traffic("m", {"v3": 90, "v2": 10}, actor="carol", detail="canary")
    d.set_traffic("m", {"v2": 100}, actor="carol", detail="promote")
    d.undeploy("m", "v1", actor="dave")
    d.rollback("m", actor="erin")

    history = d.history("m")
    assert [(h.reason, h.actor) for h in history] == [
        ("rollback", "erin"),
        ("undeploy", "dave"),
        ("manual", "carol"),
        ("manual", "carol"),
        ("deploy", "api"),
        ("deploy", "api"),
        ("deploy", "api"),
    ]
    assert history[0].detail == "back to v3" and history[1].detail == "removing v1"
    assert history[3].split == {"v3": 90, "v2": 10, "v1": 0} and history[3].detail == "canary"
    revisions = [h.revision for h in history]
    assert revisions == sorted(revisions, reverse=True) and d.revision("m") == revisions[0]
    assert d.history("m", limit=2) == history[:2]
    assert history[0].to_dict()["split"] == history[0].split
    assert d.history("other") == []


def test_stale_revision_conflicts(deployed: Registry) -> None:
    d = deployed.deployments
    read = d.revision("m")
    d.set_traffic("m", {"v3": 90, "v2": 10}, revision=read)
    with pytest.raises(Conflict, match=f"changed since revision {read}") as info:
        d.set_traffic("m", {"v3": 50, "v1": 50}, revision=read)
    assert info.value.status_code == 409 and info.value.details["revision"] == d.revision("m")
    assert split(deployed, "m") == {"v3": 90, "v2": 10, "v1": 0}
    d.set_traffic("m", {"v3": 50, "v1": 50}, revision=d.revision("m"))  # re-read: fine


def at_once(calls: list[Callable[[], object]]) -> list[object]:
    """Run each call in its own thread, released together; each outcome is the value
    returned or the exception raised."""
    barrier = threading.Barrier(len(calls))
    outcomes: list[object] = [None] * len(calls)

    def run(i: int) -> None:
        barrier.wait()
        try:
            outcomes[i] = calls[i]()
        except Exception as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def test_concurrent_changes_from_one_revision_one_wins(
    deployed: Registry, database_url: str, artifact_root: Path
) -> None:
    with Registry(database_url, artifact_root) as other:
        for round_ in range(5):
            read = deployed.deployments.revision("m")
            splits = [{"v3": 100 - round_, "v2": round_}, {"v3": 100 - round_, "v1": round_}]
            outcomes = at_once(
                [
                    functools.partial(reg.deployments.set_traffic, "m", s, revision=read)
                    for reg, s in zip((deployed, other), splits, strict=True)
                ]
            )

            winners = [i for i, o in enumerate(outcomes) if isinstance(o, TrafficRecord)]
            assert len(winners) == 1, outcomes
            assert isinstance(outcomes[1 - winners[0]], Conflict), outcomes
            new = [h for h in deployed.deployments.history("m") if h.revision > read]
            assert new == [outcomes[winners[0]]]
            assert split(deployed, "m") == new[0].split


def test_concurrent_changes_without_revision_both_apply(
    deployed: Registry, database_url: str, artifact_root: Path
) -> None:
    with Registry(database_url, artifact_root) as other:
        read = deployed.deployments.revision("m")
        outcomes = at_once(
            [
                lambda: deployed.deployments.set_traffic("m", {"v3": 50, "v2": 50}),
                lambda: other.deployments.set_traffic("m", {"v3": 50, "v1": 50}),
            ]
        )
        assert all(isinstance(o, TrafficRecord) for o in outcomes), outcomes
        new = [h for h in deployed.deployments.history("m") if h.revision > read]
        assert len(new) == 2  # one after the other: the last one is the split
        assert split(deployed, "m") == new[0].split


# -- rollback --------------------------------------------------------------------------


def test_rollback_goes_back_to_the_last_stable_split(registry: Registry, source: Path) -> None:
    push(registry, source, "m", "v1", "v2")
    d = registry.deployments
    d.deploy("m", "v1", traffic_pct=100)  # adopts v2: {v2: 100} then {v2: 0, v1: 100}
    d.set_traffic("m", {"v1": 50, "v2": 50})

    change = d.rollback("m", actor="pager")
    assert change.split == {"v2": 0, "v1": 100}
    assert (change.reason, change.actor, change.detail) == ("rollback", "pager", "back to v1")
    assert split(registry, "m") == change.split and d.revision("m") == change.revision
    # The current split is stable itself: the one before it is the target now.
    assert d.rollback("m").split == {"v2": 100, "v1": 0}


def test_rollback_skips_versions_no_longer_deployed(registry: Registry, source: Path) -> None:
    push(registry, source, "m", "a", "b", "c")
    d = registry.deployments
    d.deploy("m", "c", traffic_pct=100)
    d.deploy("m", "b", traffic_pct=100)
    d.set_traffic("m", {"c": 100})
    d.deploy("m", "a", traffic_pct=50)
    d.set_traffic("m", {"b": 50, "a": 50})
    d.undeploy("m", "c")  # the latest version at 100 % is draining now

    assert d.rollback("m").split == {"b": 100, "a": 0}
    assert statuses(registry, "m")["c"] == "draining"


def test_rollback_without_a_stable_split_is_refused(registry: Registry, source: Path) -> None:
    push(registry, source, "m", "v1", "v2")
    with pytest.raises(InvalidInput, match="no deployments to roll back"):
        registry.deployments.rollback("m")  # automatic mode
    registry.deployments.deploy("m", "v2", traffic_pct=100)
    with pytest.raises(InvalidInput, match="no earlier stable split") as info:
        registry.deployments.rollback("m")  # the only stable split is the current one
    assert info.value.status_code == 422
    assert len(registry.deployments.history("m")) == 1
    with pytest.raises(ModelNotFound):
        registry.deployments.rollback("nope")


# -- undeploy and the controller's calls -----------------------------------------------


def test_undeploy_with_traffic_conflicts(deployed: Registry) -> None:
    with pytest.raises(Conflict, match="m:v3 still takes 100 % of the traffic") as info:
        deployed.deployments.undeploy("m", "v3")
    assert info.value.status_code == 409
    assert statuses(deployed, "m")["v3"] == "deploying"
    with pytest.raises(ModelNotFound, match="'v9' of 'm' is not deployed"):
        deployed.deployments.undeploy("m", "v9")


def test_undeploy_drains_and_only_remove_deletes(deployed: Registry) -> None:
    d = deployed.deployments
    record = d.undeploy("m", "v1", actor="ops")
    assert (record.version, record.status, record.traffic_pct) == ("v1", "draining", 0)
    change = d.history("m")[0]
    assert (change.reason, change.actor, change.split) == (
        "undeploy",
        "ops",
        {"v3": 100, "v2": 0, "v1": 0},
    )
    with pytest.raises(Conflict, match="already deployed"):
        d.deploy("m", "v1", traffic_pct=0)  # until the controller removed it

    deployed.rollouts.remove("m", "v2")  # not draining: kept
    deployed.rollouts.remove("m", "v1")
    assert statuses(deployed, "m") == {"v3": "deploying", "v2": "deploying"}
    d.deploy("m", "v1", traffic_pct=0)  # gone: may be deployed again
    assert "v1" in statuses(deployed, "m")


def test_set_status_keeps_draining(deployed: Registry) -> None:
    d = deployed.deployments
    d.undeploy("m", "v1")
    revision = d.revision("m")
    deployed.rollouts.set_status("m", "v3", "active")
    deployed.rollouts.set_status("m", "v2", "failed")
    deployed.rollouts.set_status("m", "v1", "active")
    deployed.rollouts.set_status("m", "v9", "active")  # not deployed: nothing to do
    assert statuses(deployed, "m") == {"v3": "active", "v2": "failed", "v1": "draining"}
    assert d.revision("m") == revision  # a status is no traffic change
