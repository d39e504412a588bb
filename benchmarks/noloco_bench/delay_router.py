"""A user-space netem: the router of a shaped benchmark network delays every packet it forwards.

This kernel has ``tc tbf`` (bandwidth) but no ``netem`` (latency). So the router namespace of
shaped_network.py sends every packet arriving from a node's veth to a TUN device (a policy-routing rule), and this
process reads each packet from the TUN, holds it for ``delay`` (plus a jitter drawn per packet), and writes it back;
the kernel then forwards it to its destination veth. Every protocol (gRPC, gloo, libp2p) sees the latency, in
both directions, so a round trip between two nodes takes twice ``delay``.

Packets leave in arrival order (a jittered packet never overtakes an earlier one: TCP treats reordering as loss,
which netem's jitter would also cause but a real path rarely does). Links use a 64 KB MTU so that the packet rate
through this Python loop stays in the thousands per second at the bandwidths benchmarked.

Run inside the router namespace: ``ip netns exec ROUTER python -m noloco_bench.delay_router TUN DELAY_MS``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import random
import select
import struct
import sys
import time
from collections import deque

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def run(fd: int, delay: float, jitter: float, seed: int = 0) -> None:
    rng = random.Random(seed)
    held: deque[tuple[float, bytes]] = deque()
    last_release = 0.0
    while True:
        wait = max(0.0, held[0][0] - time.monotonic()) if held else None
        readable, _, _ = select.select([fd], [], [], wait)
        if readable:
            now = time.monotonic()
            while True:
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                release = now + delay + (rng.uniform(-jitter, jitter) if jitter else 0.0)
                last_release = max(last_release, release)  # never overtake an earlier packet
                held.append((last_release, packet))
        now = time.monotonic()
        while held and held[0][0] <= now:
            with contextlib.suppress(OSError):  # an unroutable packet is dropped, as a router would
                os.write(fd, held.popleft()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tun")
    parser.add_argument("delay_ms", type=float, help="one-way delay added to every packet")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="uniform +- jitter per packet")
    args = parser.parse_args()
    fd = open_tun(args.tun)
    print("ready", flush=True)
    sys.stdout.close()
    run(fd, args.delay_ms / 1000, args.jitter_ms / 1000)


if __name__ == "__main__":
    main()
