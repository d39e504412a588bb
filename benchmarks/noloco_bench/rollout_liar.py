"""A hostile member of an RL run (`noloco-node rl`): it joins the run's DHT with a key of its own, names a new round
in its record every second, and serves rollouts built to deceive or to break the receiver (the tests of
docs/rl.md's promises run it):

- ``wrong``: well-formed rollouts of real tasks whose completions are all wrong answers. The protocol has no field
  for a reward or an answer, so a liar can only say its completions are good in words; a receiver that scores
  them itself gives them 0, every advantage in the group is 0, and its policy does not move for them.
- ``group_size``, ``unknown_family``, ``completion_too_long``, ``round``, ``peer``, ``too_many_groups``,
  ``task_range``: a batch malformed in that one way, which the receiver must refuse whole and count under that
  reason.

``python -m noloco_bench.rollout_liar --bootstrap MADDR --run-name NAME --lie wrong --seconds 30`` prints one JSON
line at the end: the batches it served. ``--lie wrong,round,...`` runs several liars in one process, each a member
of its own (its own key, DHT peer and server), and prints a line for each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from noloco_node.discovery.dht import Discovery, PeerRecord
from noloco_node.rl.node import rl_run_fingerprint
from noloco_node.rl.rollouts import MAX_COMPLETION_CHARS, MAX_GROUPS, RolloutBook, SharedGroup
from noloco_node.rl.served import RolloutPeerNode
from noloco_node.rl.tasks import TaskRef, TaskSampler
from noloco_node.rpc.metrics import ExchangeMetrics
from noloco_node.rpc.service import start_server
from noloco_node.wire import peer_pb2 as pb

LIES = ("wrong", "group_size", "unknown_family", "completion_too_long", "round", "peer", "too_many_groups",
        "task_range")  # fmt: skip


class LyingBook(RolloutBook):
    """A book whose batches are wrong answers, or malformed in one way."""

    def __init__(self, run_fingerprint: str, peer_id: str, lie: str) -> None:
        super().__init__(run_fingerprint, peer_id)
        self.lie = lie
        self.sampler = TaskSampler(["chain_sum"], seed=99)

    def batch(self, round_: int) -> pb.RolloutBatch | None:
        tasks = self.sampler.draw(4)
        groups = [SharedGroup(t.ref, ("I am sure it is right",) * 8) for t in tasks]  # wrong, whatever it says
        if self.lie == "group_size":
            groups[0] = SharedGroup(groups[0].ref, groups[0].completions[:1])
        elif self.lie == "unknown_family":
            groups[0] = SharedGroup(TaskRef("no_such_family", 1, 1), groups[0].completions)
        elif self.lie == "completion_too_long":
            groups[0] = SharedGroup(groups[0].ref, ("x" * (MAX_COMPLETION_CHARS + 1),) * 8)
        elif self.lie == "too_many_groups":
            groups = groups * (MAX_GROUPS // len(groups) + 1)
        elif self.lie == "task_range":
            groups[0] = SharedGroup(TaskRef("chain_sum", 1, 10**9), groups[0].completions)
        batch = pb.RolloutBatch(
            run_fingerprint=self.run_fingerprint,
            peer_id="someone-else" if self.lie == "peer" else self.peer_id,
            round=round_ + 1 if self.lie == "round" else round_,
            groups=[
                pb.RolloutGroup(family=g.ref.family, seed=g.ref.seed, index=g.ref.index, completions=g.completions)
                for g in groups
            ],
        )
        self.served_batches += 1
        return batch


async def lie(bootstrap: list[str], run_name: str, kind: str, seconds: float) -> dict:
    fingerprint = rl_run_fingerprint(run_name)
    discovery = Discovery(fingerprint, initial_peers=bootstrap, record_ttl=10.0)
    await asyncio.to_thread(discovery.start)
    book = LyingBook(fingerprint, discovery.peer_id, kind)
    served = RolloutPeerNode(fingerprint, lambda: discovery.peer_id, lambda: pb.InfoReply(peer_id=discovery.peer_id))
    server, port = start_server(served, ExchangeMetrics(), bind="127.0.0.1:0", rollouts=book)
    try:
        deadline = time.monotonic() + seconds
        round_ = 0
        while time.monotonic() < deadline:
            round_ += 1
            record = PeerRecord(
                peer_id=discovery.peer_id,
                address=f"127.0.0.1:{port}",
                run_fingerprint=fingerprint,
                rollout_round=round_,
                rollout_families=("chain_sum",),
            )
            await asyncio.wait_for(discovery.publish(record), 10)
            await asyncio.sleep(1.0)
    finally:
        server.stop(grace=1).wait(3)
        await asyncio.to_thread(discovery.shutdown)
    return {"lie": kind, "served_batches": book.served_batches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", nargs="+", required=True)
    parser.add_argument("--run-name", required=True)
    parser.add_argument("--lie", default="wrong", help=f"comma-separated, of: {', '.join(LIES)}")
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    kinds = args.lie.split(",")
    if unknown := [kind for kind in kinds if kind not in LIES]:
        parser.error(f"--lie: unknown {', '.join(unknown)} (choose from {', '.join(LIES)})")

    async def all_of_them() -> list[dict]:
        return await asyncio.gather(*(lie(args.bootstrap, args.run_name, kind, args.seconds) for kind in kinds))

    for report in asyncio.run(all_of_them()):
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
