"""Orchestrators: what makes a running version's replicas match ``vset.desired``,
wherever they run.

The controller decides *what* runs (versions, their replica counts, which one serves);
an orchestrator runs it: processes on this machine, each kept alive by a supervisor
(:mod:`~inferd.control.orchestrators.processes`, ``replica_backend: local``), or a
Deployment of replica pods per version that Kubernetes keeps alive
(:mod:`~inferd.control.orchestrators.kubernetes`, ``replica_backend: kubernetes``). It
puts the replicas it runs into their version's set (:class:`~inferd.control.replica.Replica`),
where the controller routes, counts and stops them without knowing their kind.

Replicas that join from other hosts are no orchestrator's: the controller keeps them
beside its orchestrator (:class:`~inferd.control.joined.Joins`), and an orchestrator
that runs replicas here counts the ready ones among ``desired``.

A new kind (Ray, Nomad) is a module implementing :class:`Orchestrator`, an entry in
:data:`ORCHESTRATORS` and its name among those ``replica_backend`` accepts
(:mod:`inferd.config`); the controller does not change. ``tests/test_controller.py``
drives the controller through one kept in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from inferd.clock import Clock
from inferd.config import Settings

if TYPE_CHECKING:
    from inferd.control.autoscaler import Decision
    from inferd.control.backends import ReplicaBackend
    from inferd.control.replica import Replica
    from inferd.control.state import ModelState, VersionSet


@dataclass(frozen=True)
class Context:
    """What the controller shares with its orchestrator (and its joins): its state, its
    clock, and the calls back into it."""

    models: dict[str, ModelState]
    """The controller's models: the version sets the replicas go into."""
    clock: Clock
    on_change: Callable[[Replica], None]
    """A replica's state changed: the controller publishes a table (and, for a replica
    turning ready, the serving version it makes in the same one)."""
    publish: Callable[[], None]
    """Send gateways a new table (after a replica left its version's set)."""
    spawn: Callable[[Coroutine[Any, Any, None]], None]
    """Run in the background; the controller waits for it when it stops."""
    reconcile_soon: Callable[[], None]
    """Ask for a reconcile pass (none while the controller stops)."""
    may_start: Callable[[], bool]
    """False while replicas on other hosts rejoin a new controller: nothing starts."""
    capacity: Callable[[str, str, Decision], None]
    """A ``capacity`` scaling event of ``model:version`` (no room for a replica):
    counted for ``/metrics`` and recorded."""


class Orchestrator(Protocol):
    """Runs the replicas of the controller's versions; see the module's docstring."""

    machine_bound: bool
    """Its replicas run on this machine: its memory and idle cores bound scale-ups (False:
    a cluster scheduler decides what fits)."""

    async def start(self) -> None:
        """Before the first pass: find what already runs (it is adopted, not restarted)."""
        ...

    def scale(self, vset: VersionSet, *, shrink: bool = True) -> None:
        """Run ``vset.desired`` replicas of the version, less the ready ones that joined
        from other hosts; extra ones drain. ``shrink`` False (a model in automatic mode):
        only start what is missing."""
        ...

    def running(self, model: str, version: str) -> int:
        """Replicas of ``model:version`` it runs already, before their version's set
        exists (what a new controller's autoscaler goes on from)."""
        ...

    def gpus(self, vset: VersionSet) -> list[int] | None:
        """The devices of this machine for the deployment's ``vset.gpu_type``, each replica
        placed on one of them; None: none chosen here (a scheduler places them)."""
        ...

    def gpu_room(self, vset: VersionSet) -> tuple[int, str] | None:
        """How many replicas of ``vset`` its GPUs hold, and the limit's wording; None:
        no bound (no GPU asked for, or not this machine's to say)."""
        ...

    def sync(self) -> None:
        """Each pass, after the versions were reconciled: their sets hold the replicas it
        runs (those it was told of before their version ran here)."""
        ...

    def keep_only(self, running: set[tuple[str, str]]) -> None:
        """After the first pass: what it runs of any other ``(model, version)`` goes
        (versions retired while no controller ran)."""
        ...

    def retire(self, model: str, version: str) -> None:
        """``model:version`` runs nothing from now on (the controller stops the replicas
        in its set)."""
        ...

    async def close(self) -> None:
        """The controller stops: stop what must not outlive it; replicas another
        controller can adopt keep serving."""
        ...


Make = Callable[[Settings, Path, Context, "ReplicaBackend | None"], Orchestrator]
"""Builds an orchestrator from the settings, the run folder, the controller's context
and the replica backend the server was given (embedding, tests), if any."""


def _processes(
    settings: Settings, run_dir: Path, context: Context, backend: ReplicaBackend | None
) -> Orchestrator:
    from inferd.control import backends
    from inferd.control.orchestrators.processes import Processes

    backend = backend or backends.create(
        "local", run_dir, settings.shutdown_grace_s, settings.models.fork_server
    )
    if settings.models.versions_per_process > 1 and backend.name == "local":
        from inferd.control.backends.shared import SharedBackend

        backend = SharedBackend(
            run_dir, settings.shutdown_grace_s, settings.models.versions_per_process,
            settings.models.predict_budget_s, backend, settings.log_level,
            settings.models.process_memory_mb * 2**20,
        )  # fmt: skip
    return Processes(settings, backend, context)


def _kubernetes(
    settings: Settings, run_dir: Path, context: Context, backend: ReplicaBackend | None
) -> Orchestrator:
    from inferd.control.orchestrators.kubernetes import Kubernetes

    return Kubernetes(settings, context)


ORCHESTRATORS: dict[str, Make] = {"local": _processes, "kubernetes": _kubernetes}
"""``replica_backend`` -> how to build its orchestrator."""


def orchestrator_for(
    settings: Settings, run_dir: Path, context: Context, backend: ReplicaBackend | None = None
) -> Orchestrator:
    """The orchestrator ``settings.replica_backend`` names."""
    make = ORCHESTRATORS.get(settings.replica_backend)
    if make is None:
        raise ValueError(
            f"unknown replica_backend {settings.replica_backend!r}; "
            f"available: {', '.join(sorted(ORCHESTRATORS))}"
        )
    return make(settings, run_dir, context, backend)
