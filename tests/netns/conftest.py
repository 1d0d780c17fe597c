"""Two hosts for tests: network namespaces joined by a veth pair, made and removed here."""

from __future__ import annotations

import random
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

IP_TIMEOUT_S = 10.0


@dataclass
class Pair:
    """Two namespaces ``a`` and ``b``; ``addr_a``/``addr_b`` are their veth addresses."""

    a: str
    b: str
    addr_a: str
    addr_b: str


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S,
                          check=False)


def _must(*args: str) -> None:
    done = _ip(*args)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@pytest.fixture
def netns_pair() -> Iterator[Pair]:
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed; network namespaces cannot be made")
    tag = secrets.token_hex(3)
    ns_a, ns_b = f"shoal-{tag}-a", f"shoal-{tag}-b"
    veth_a, veth_b = f"sv{tag}a", f"sv{tag}b"
    net = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
    addr_a, addr_b = f"{net}.1", f"{net}.2"
    made: list[str] = []
    try:
        first = _ip("netns", "add", ns_a)
        if first.returncode != 0:
            pytest.skip(f"cannot make a network namespace (`ip netns add` said: "
                        f"{first.stderr.strip()}); run as root or with CAP_SYS_ADMIN")
        made.append(ns_a)
        try:
            _must("netns", "add", ns_b)
            made.append(ns_b)
            _must("link", "add", veth_a, "netns", ns_a, "type", "veth",
                  "peer", "name", veth_b, "netns", ns_b)
            for ns, dev, addr in ((ns_a, veth_a, addr_a), (ns_b, veth_b, addr_b)):
                _must("-n", ns, "link", "set", "lo", "up")
                _must("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _must("-n", ns, "link", "set", dev, "up", "multicast", "on")
                _must("-n", ns, "route", "add", "224.0.0.0/4", "dev", dev)
        except RuntimeError as exc:
            pytest.skip(f"cannot join two network namespaces with a veth pair ({exc})")
        yield Pair(ns_a, ns_b, addr_a, addr_b)
    finally:
        for ns in made:  # deleting a namespace removes its end of the veth, so the pair
            _ip("netns", "del", ns)


