"""A member that turns hostile: a real stream node that earns standing honestly, then shrinks its partners' weights.

Run as ``python -m noloco_bench.turncoat --honest-seconds S [--size F] -- <noloco-node arguments>``: the whole node
(``noloco-node join``: its DHT record, its training, its blends), except that once it has been up for S seconds
every phase progress it sends is minus its own phi, scaled to F (0.85) of the norm bound its own node had then,
as the receiver decodes it (outsider.shrinking_progress): a key with standing, which an outsider's free keys
cannot buy, spending it on the attack of issue 45 that the norm bound alone does not stop. The bound is its own,
frozen when it turns: an honest member's bound is what the receiver's is, to within the drift between them.

Used by ``noloco-node bench outsider --mode stream`` (outsider_swarm.py). On SIGTERM the node leaves as any node
does, and this prints what it did as one JSON line on stdout (the node logs to stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from noloco_bench.outsider import shrinking_progress
from noloco_node import algorithm
from noloco_node.cli.main import main as node_main
from noloco_node.observability.status_file import read_status_document


class Turncoat:
    """The phase progress of a node that turns hostile ``honest_seconds`` after it starts."""

    def __init__(self, data_dir: Path, honest_seconds: float, size: float, wire_dtype: str) -> None:
        self.data_dir = data_dir
        self.turns_at = time.monotonic() + honest_seconds
        self.size = size
        self.wire_dtype = wire_dtype
        self.bound: float | None = None  # its own norm bound when it turned
        self.honest = self.hostile = 0  # progresses built each way (a phase it won; delivered or not)
        self._lock = threading.Lock()
        self._honest_progress = algorithm.phase_progress

    def phase_progress(self, theta: Sequence[torch.Tensor], phi: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with self._lock:
            if self.bound is None and time.monotonic() >= self.turns_at:
                status = read_status_document(self.data_dir) or {}
                self.bound = (status.get("security") or {}).get("norm_bound")
            hostile = self.bound is not None
            if hostile:
                self.hostile += 1
            else:
                self.honest += 1
        if not hostile:
            return self._honest_progress(theta, phi)
        assert self.bound is not None
        return shrinking_progress(phi, self.size * self.bound, self.wire_dtype)

    def report(self) -> dict[str, object]:
        status = read_status_document(self.data_dir) or {}
        return {
            "peer_id": status.get("peer_id"),
            "bound": self.bound,
            "honest_progress": self.honest,
            "hostile_progress": self.hostile,
        }


def _option(args: Sequence[str], name: str, default: str) -> str:
    return args[args.index(name) + 1] if name in args else default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--honest-seconds", type=float, required=True)
    parser.add_argument("--size", type=float, default=0.85, help="of its own norm bound")
    parser.add_argument("node_args", nargs=argparse.REMAINDER, help="-- then noloco-node's arguments")
    args = parser.parse_args()
    node_args = args.node_args[1:] if args.node_args[:1] == ["--"] else args.node_args
    turncoat = Turncoat(
        Path(_option(node_args, "--data-dir", ".")),
        args.honest_seconds,
        args.size,
        _option(node_args, "--wire-dtype", "int8"),
    )
    algorithm.phase_progress = turncoat.phase_progress  # stream.py calls it as algorithm.phase_progress
    code: object = 1
    try:
        code = node_main(node_args)
    except SystemExit as exit_:
        code = exit_.code
    finally:
        print(json.dumps(turncoat.report(), sort_keys=True), flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
