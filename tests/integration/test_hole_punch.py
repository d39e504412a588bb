"""discovery/hole_punch.py through real NATs (nftables masquerade in network namespaces, noloco_bench/nat_network.py):
a member behind any NAT connects out to a listening caller (reversal); two members behind port-keeping NATs
connect by simultaneous open when their SYNs leave together; a symmetric NAT defeats the simultaneous open, which
gives up within its deadline (the relay then carries the tunnel). Each end runs in its own namespace as its own
process, as nodes do."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from noloco_bench.nat_network import Home, NatNetwork, nat_network
from noloco_node.discovery.hole_punch import PUNCH_SECONDS

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
    pytest.mark.skipif(shutil.which("nft") is None and not os.environ.get("CI"), reason="needs nftables (.ci/run has)"),
]

END = """
import asyncio, sys, time
from noloco_node.discovery.hole_punch import accept_from, bound_socket, connect_from

async def main(way, port, host, other_port, at):
    await asyncio.sleep(max(0.0, at - time.time()))  # both ends start together, as the relay's timing makes them
    started = time.monotonic()
    if way == "listen":
        sock = await accept_from(bound_socket(port, listen=True), host)
    else:
        sock = await connect_from(bound_socket(port), host, other_port)
    seconds = time.monotonic() - started
    if sock is None:
        print(f"none {seconds:.2f}", flush=True)
        return
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(f"{port}\\n".encode())
    await writer.drain()
    heard = (await asyncio.wait_for(reader.readline(), 5)).decode().strip()
    print(f"connected {seconds:.2f} heard {heard}", flush=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5])))
"""


@pytest.fixture(scope="module")
def net() -> Iterator[NatNetwork]:
    homes = (Home("port_restricted", 1), Home("symmetric", 1), Home("port_restricted", 1))
    with nat_network(1, homes, rate_mbit=100, rtt_ms=40, prefix="nltpunch") as network:
        yield network


def ends(net: NatNetwork, a: int, a_way: str, b: int, b_way: str, base: int) -> tuple[str, str]:
    """One end in member ``a``'s namespace and the other in ``b``'s, started together; what each printed."""
    first, second = net.members[a], net.members[b]
    at = str(time.time() + 2.0)  # one clock for both namespaces: the ends start within a millisecond of each other
    plans = ((first, a_way, base, second, base + 1), (second, b_way, base + 1, first, base))
    processes = []
    for member, way, port, other, other_port in plans:
        arguments = [way, str(port), other.public_address, str(other_port), at]
        command = [*member.exec_prefix(), sys.executable, "-c", END, *arguments]
        processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return tuple(process.communicate(timeout=60)[0].strip() for process in processes)  # type: ignore[return-value]


def test_a_member_behind_any_nat_connects_out_to_a_listening_caller(net: NatNetwork) -> None:
    for member, base in ((1, 41000), (2, 41010)):  # port-restricted, then symmetric
        caller, callee = ends(net, 0, "listen", member, "connect", base)
        assert caller.startswith("connected") and caller.endswith(f"heard {base + 1}"), (member, caller, callee)
        assert callee.startswith("connected") and callee.endswith(f"heard {base}"), (member, caller, callee)


def test_two_port_keeping_nats_connect_by_simultaneous_open(net: NatNetwork) -> None:
    one, other = ends(net, 1, "connect", 3, "connect", 41020)
    assert one.startswith("connected") and one.endswith("heard 41021"), (one, other)
    assert other.startswith("connected") and other.endswith("heard 41020"), (one, other)


def test_a_symmetric_nat_defeats_the_simultaneous_open_within_the_deadline(net: NatNetwork) -> None:
    one, other = ends(net, 1, "connect", 2, "connect", 41030)
    for printed in (one, other):
        verdict, seconds = printed.split()[:2]
        assert verdict == "none" and float(seconds) <= PUNCH_SECONDS + 0.5, (one, other)
