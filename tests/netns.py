"""Network hosts on this machine for multi-host tests: Linux network namespaces, each
with a veth pair into a bridge in the test's own namespace (the "switch"), addresses
in a private range; created and removed by the test. Needs root and iproute2."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
from dataclasses import dataclass, field


def available() -> str | None:
    """None when namespaces can be made here, else why not (for a skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2 (ip)"
    probe = f"inferd-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *args] if netns is None else ["ip", "netns", "exec", netns, "ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@dataclass
class Host:
    name: str
    netns: str
    address: str
    link: str
    """Its veth end on the switch: down cuts the host off."""

    def run(self, *cmd: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        """A process on this host (in its own process group)."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.netns, *cmd],
            env={**os.environ, **(env or {})},
            start_new_session=True,
            **kw,
        )

    def kill_all(self) -> None:
        """SIGKILL every process of this host (``ip netns pids``)."""
        out = subprocess.run(
            ["ip", "netns", "pids", self.netns], capture_output=True, text=True
        ).stdout
        for pid in out.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)

    def cut(self) -> None:
        _ip("link", "set", self.link, "down")

    def restore(self) -> None:
        _ip("link", "set", self.link, "up")


@dataclass
class Network:
    """The switch (a bridge here, at ``.1``) and hosts at ``.2``, ``.3``, …"""

    tag: str = field(default_factory=lambda: f"{random.randrange(16**4):04x}")
    subnet: int = field(default_factory=lambda: random.randrange(100, 250))
    hosts: list[Host] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"ibr{self.tag}"

    @property
    def gateway_address(self) -> str:
        """This (the test's) namespace on the switch."""
        return f"10.213.{self.subnet}.1"

    def __enter__(self) -> Network:
        taken = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
        while f"10.213.{self.subnet}." in taken:  # another test's network (a parallel run)
            self.subnet = random.randrange(100, 250)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        return self

    def add(self, name: str) -> Host:
        index = len(self.hosts) + 2
        netns = f"inferd-{self.tag}-{name}"
        outside, inside = f"iv{self.tag}{name}"[:15], f"ih{self.tag}{name}"[:15]
        _ip("netns", "add", netns)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", netns)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        address = f"10.213.{self.subnet}.{index}"
        _ip("addr", "add", f"{address}/24", "dev", inside, netns=netns)
        _ip("link", "set", inside, "up", netns=netns)
        _ip("link", "set", "lo", "up", netns=netns)
        host = Host(name, netns, address, outside)
        self.hosts.append(host)
        return host

    def __exit__(self, *exc: object) -> None:
        for host in self.hosts:
            host.kill_all()
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
            subprocess.run(["ip", "link", "del", host.link], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
