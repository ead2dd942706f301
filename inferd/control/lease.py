"""Leader election through a Kubernetes Lease (``coordination.k8s.io/v1``).

On Kubernetes several ``inferd control`` pods may run (a Deployment with more than one
replica, or an old and a new pod during a rolling update); one leads, the others wait
and do nothing, as with the registry's lock (:mod:`inferd.control.leader`), which is
still taken after the Lease: the Lease is what Kubernetes tools show (``kubectl get
lease``), the database lock what keeps the registry's writers single.

The rules are client-go's leader election:

- a candidate takes the Lease when nobody holds it, or when the holder's record has
  not changed for ``lease_duration_s`` *as this candidate observed it* (its own clock
  only: no trust in the other pod's clock);
- the leader renews every third of the duration; a write that loses a race (409, the
  ``resourceVersion`` moved) is re-read, never forced;
- a leader that cannot renew for two thirds of the duration stops leading
  (:attr:`LeaseLeadership.lost`) before anyone else may take over;
- a leader that stops releases the Lease (holder cleared), so a successor takes over at
  once instead of after the duration.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

from inferd.config import KubernetesConfig

logger = logging.getLogger(__name__)
RETRY_S = 1.0


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class LeaseLeadership:
    """Held while this process leads; :attr:`lost` is set when it must stop leading."""

    def __init__(self, kube: KubernetesConfig, namespace: str, client: Any, identity: str) -> None:
        self.kube = kube
        self.namespace = namespace
        self.client = client
        self.identity = identity
        self.lost = asyncio.Event()
        self.why = ""
        self._lease: Any = None
        self._observed: tuple[Any, float] = (None, 0.0)
        """(the holder's record as last seen, when this process saw it change)."""
        self._renew: asyncio.Task[None] | None = None
        self._on_lost: Callable[[str], None] = lambda _: None

    def lost_to(self, on_lost: Callable[[str], None]) -> None:
        """``on_lost(why)`` is called once this process stops leading."""
        self._on_lost = on_lost

    @classmethod
    async def acquire(
        cls,
        kube: KubernetesConfig,
        namespace: str,
        progress: Callable[[str], None],
        client: Any = None,
        identity: str | None = None,
    ) -> LeaseLeadership:
        """Wait until this process holds the Lease."""
        from inferd.control.backends.kubernetes import connect, unavailable

        if client is None:
            client = connect(namespace)
        self = cls(kube, namespace, client, identity or socket.gethostname())
        said = False
        try:
            taken = await self._try()
        except Exception as exc:  # refused (RBAC) or unreachable: nothing to lead with
            await client.close()
            raise unavailable(f"the Lease {namespace}/{kube.lease_name}", exc) from None
        while not taken:
            if not said:
                holder = self._lease.spec.holderIdentity if self._lease is not None else "?"
                progress(
                    f"controller {holder} leads (Lease {namespace}/{kube.lease_name}); "
                    "following, taking over when it goes"
                )
                said = True
            await asyncio.sleep(RETRY_S)
            try:
                taken = await self._try()
            except Exception as exc:  # the API went away for a while: keep following
                logger.warning("reading the Lease failed: %r", exc)
        if said:
            progress(f"this controller ({self.identity}) leads now")
        logger.info("leading: Lease %s/%s held by %s", namespace, kube.lease_name, self.identity)
        self._renew = asyncio.get_running_loop().create_task(self._renew_forever())
        return self

    async def _try(self) -> bool:
        """One attempt to take (or keep) the Lease."""
        from lightkube import ApiError
        from lightkube.models.coordination_v1 import LeaseSpec
        from lightkube.models.meta_v1 import ObjectMeta
        from lightkube.resources.coordination_v1 import Lease

        duration = int(self.kube.lease_duration_s)
        try:
            lease = await self.client.get(Lease, self.kube.lease_name, namespace=self.namespace)
        except ApiError as exc:
            if exc.status.code != 404:
                raise
            fresh = Lease(
                metadata=ObjectMeta(name=self.kube.lease_name, namespace=self.namespace),
                spec=LeaseSpec(
                    holderIdentity=self.identity,
                    leaseDurationSeconds=duration,
                    acquireTime=_now(),
                    renewTime=_now(),
                    leaseTransitions=0,
                ),
            )
            try:
                self._lease = await self.client.create(fresh)
            except ApiError as race:
                if race.status.code != 409:
                    raise
                return False  # another candidate created it first
            return True
        self._lease = lease
        spec = lease.spec
        record = (spec.holderIdentity, spec.renewTime, spec.leaseDurationSeconds)
        if record != self._observed[0]:
            self._observed = (record, time.monotonic())
        mine = spec.holderIdentity == self.identity
        held = bool(spec.holderIdentity) and not mine
        expired = time.monotonic() - self._observed[1] > (spec.leaseDurationSeconds or duration)
        if held and not expired:
            return False
        if not mine:
            spec.acquireTime = _now()
            spec.leaseTransitions = (spec.leaseTransitions or 0) + 1
        spec.holderIdentity = self.identity
        spec.leaseDurationSeconds = duration
        spec.renewTime = _now()
        try:
            self._lease = await self.client.replace(lease)
        except ApiError as exc:
            if exc.status.code != 409:
                raise
            return False  # its resourceVersion moved: read it again
        return True

    async def _renew_forever(self) -> None:
        duration = self.kube.lease_duration_s
        last = time.monotonic()
        while True:
            await asyncio.sleep(duration / 3)
            try:
                renewed = await asyncio.wait_for(self._try(), duration / 3)
            except Exception as exc:  # the API is unreachable: count it as not renewed
                logger.warning("renewing the Lease failed: %r", exc)
                renewed = False
            if renewed:
                last = time.monotonic()
                continue
            holder = self._lease.spec.holderIdentity if self._lease is not None else None
            if holder not in (None, "", self.identity):
                self.why = f"the Lease was taken by {holder}"
            elif time.monotonic() - last > duration * 2 / 3:
                self.why = f"could not renew the Lease for {time.monotonic() - last:.1f}s"
            else:
                continue
            logger.critical("stopped leading: %s", self.why)
            self.lost.set()
            self._on_lost(self.why)
            return

    async def release(self) -> None:
        """Stop renewing and clear the holder, so a follower takes over at once.

        The Lease is read again first: a renewal cancelled while its write was in
        flight may have moved the ``resourceVersion`` past the copy held here, and a
        write with the old one would be refused (409) and leave the holder set.
        """
        from lightkube import ApiError
        from lightkube.resources.coordination_v1 import Lease

        if self._renew is not None:
            self._renew.cancel()
            await asyncio.gather(self._renew, return_exceptions=True)
        if self._lease is not None and not self.lost.is_set():
            for _ in range(3):
                try:
                    lease = await self.client.get(
                        Lease, self.kube.lease_name, namespace=self.namespace
                    )
                    if lease.spec.holderIdentity != self.identity:
                        break  # taken over already: not this process's to clear
                    lease.spec.holderIdentity = ""
                    lease.spec.leaseDurationSeconds = 1
                    await self.client.replace(lease)
                    break
                except ApiError as exc:
                    if exc.status.code == 409:
                        continue  # written meanwhile: read it again
                    logger.warning("could not release the Lease: %s", exc)
                    break
                except OSError as exc:
                    logger.warning("could not release the Lease: %s", exc)
                    break
        await self.client.close()
