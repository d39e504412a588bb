"""An open swarm against identities that cost nothing (docs/threat-model.md, "Partner capture"): real node
processes, the real DHT and gRPC, and the fresh-key flood of noloco_bench/echo_flood.py as a process of its
own. Each of its keys has a server on an outsider's address and a signed ready record, answers every exchange
with the caller's own weights and calls the honest nodes with theirs: every payload passes every check."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from noloco_node.node.fault_injection import Drill

from .swarm_harness import Bootstrap, NodeProcess, run_attacker, stop_all, wait_for_steps_after

TRAIN = ["--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2"]
WINDOW = 15.0  # seconds of each window
# A fresh key lives shorter than a peer takes to earn standing: it is a stranger for all its life. (A patient
# attacker's keys that outlive it and win a stranger step join the established peers, where one address weighs as
# one host: docs/threat-model.md.)
STANDING_SECONDS = 15.0
KEY_LIFE = 12.0
READY_WITHIN = 60.0  # the flood reads every node's weights before it begins: at most this long


def _steps(nodes: list[NodeProcess], start: float, end: float) -> list[dict]:
    """Every node's outer steps that ended in the window (a node's status keeps its last 200: enough)."""
    return [h for n in nodes for h in (n.status() or {}).get("history", []) if start < h["time"] <= end]


def _flood(nodes: list[NodeProcess], hosts: str) -> tuple[list[dict], dict]:
    args = ("--hosts", hosts, "--key-life", str(KEY_LIFE), "--ready-within", str(READY_WITHIN))
    _, seen = run_attacker("noloco_bench.echo_flood", nodes, WINDOW, *args, preparation=READY_WITHIN)
    wait_for_steps_after(nodes, time.time())  # a step the flood held may end after it exits
    return _steps(nodes, seen["began"], time.time()), seen  # from when it had weights to echo


def _shares(steps: list[dict], honest: set[str]) -> tuple[float, float, str]:
    """(share of outer steps blended with the attacker, share blended with an honest node, a summary)."""
    with_attacker = sum(1 for h in steps if h["partner"] and h["partner"] not in honest)
    with_honest = sum(1 for h in steps if h["partner"] in honest)
    total = max(1, len(steps))
    return with_attacker / total, with_honest / total, f"{with_attacker}+{with_honest} of {len(steps)} steps"


def _swarm(bootstrap: Bootstrap, base: Path, *extra: str) -> list[NodeProcess]:
    args = [*TRAIN, "--steps", "100000", "--inner-steps", "20", "--warmup-steps", "10", "--wait-for-peers", "3"]
    return [
        NodeProcess(
            f"n{i}",
            bootstrap,
            base,
            *args,
            "--shard-index",
            str(i),
            "--standing-seconds",
            str(STANDING_SECONDS),
            *extra,
        )
        # Four: an even swarm pairs everyone at every step. With three, the odd node waits every round; under the
        # flood's load one fell 4 steps behind, was judged a straggler and trained alone (the note of this stop).
        for i in range(4)
    ]


def _established(nodes: list[NodeProcess]) -> set[str]:
    """The honest ids, once every node has seen the others for --standing-seconds and blended with them."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        statuses = [n.status() for n in nodes]
        if all(s and s["outer_step"] >= 3 and s["uptime_seconds"] > STANDING_SECONDS + 3 for s in statuses):
            return {s["peer_id"] for s in statuses}  # type: ignore[index]
        time.sleep(0.5)
    raise AssertionError("the honest swarm did not get going")


@pytest.mark.slow  # a soak of about three minutes under two floods: `make test-slow`
def test_a_fresh_key_flood_from_one_or_several_addresses_takes_at_most_its_share_of_rounds(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    nodes = _swarm(bootstrap, tmp_path)
    try:
        honest = _established(nodes)
        start = time.time()
        time.sleep(WINDOW)
        quiet = _steps(nodes, start, time.time())
        _, quiet_rate, quiet_summary = _shares(quiet, honest)
        one_host, one_seen = _flood(nodes, "127.0.0.2")
        many_hosts, many_seen = _flood(nodes, "127.0.0.2,127.0.0.3,127.0.0.4,127.0.0.5")
        print(
            f"attacker+honest blends: no flood {quiet_summary}; flood from one address {_shares(one_host, honest)[2]} "
            f"(the flood: {one_seen['report']}); from four {_shares(many_hosts, honest)[2]} ({many_seen['report']})"
        )
        assert len(quiet) >= 30 and quiet_rate >= 0.5, quiet_summary
        for steps, seen in ((one_host, one_seen), (many_hosts, many_seen)):
            attacker_share, honest_rate, summary = _shares(steps, honest)
            assert len(steps) >= 30, summary
            # It minted keys through the window (one every 3 s; at the lowest priority under load, 4 in 15 s once).
            assert seen["report"].get("keys", 0) >= 3 and seen["report"].get("records", 0) > 0, seen
            # The flood was there to be taken: the nodes answered its calls, or met its keys on a stranger turn.
            report = seen["report"]
            assert report.get("called OK", 0) + report.get("met", 0) + report.get("echoed", 0) >= 1, seen
            assert attacker_share <= 0.2, summary
            assert honest_rate >= 0.7 * quiet_rate, (summary, quiet_summary)
        assert all(n.process.poll() is None for n in nodes)
    finally:
        stop_all(nodes)


def test_a_caller_that_refuses_the_servers_payload_leaves_both_sides_unblended(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    """n0 refuses every payload (a norm bound of 1e-9); n1 is an ordinary node. When n0 calls, n1 has admitted
    n0's payload before n0 judges n1's: n1 must not blend with a partner that did not blend with it.

    n0 trains three times slower, so n1 is already waiting in its round when n0 reaches its outer step; n0 calls its
    reserved partner the moment its round opens (pairing/reserved.py), between n1's tries. One of n1's tries that
    gets in first instead ends that round for both (n0 refuses n1's payload as the server), and the next round is
    another chance: n0 still calls the partner it set aside for drift once the pair is reserved."""
    args = [*TRAIN, "--steps", "100000", "--inner-steps", "10", "--avoid-seconds", "0.2"]
    slow = Drill(slow_factor=3.0).environment()
    refusing = NodeProcess(
        "n0", bootstrap, tmp_path, *args, "--shard-index", "0", "--pair-timeout", "2", "--norm-bound", "1e-9", env=slow
    )
    ordinary = NodeProcess("n1", bootstrap, tmp_path, *args, "--shard-index", "1", "--pair-timeout", "10")
    nodes = [refusing, ordinary]
    try:
        served_at = None  # n1's outer step when n0's call was served and not committed
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            statuses = [n.status() or {} for n in nodes]
            if served_at is None and statuses[1].get("exchange_outcomes", {}).get("not_committed", 0) >= 1:
                served_at = statuses[1]["outer_step"]
            if served_at is not None and statuses[1]["outer_step"] > served_at:
                break  # the round n1 served in has ended: its history says whether it blended
            time.sleep(0.5)
        statuses = [n.status() for n in nodes]
        assert all(statuses), statuses
        ids = [s["peer_id"] for s in statuses]  # type: ignore[index]
        outcomes = statuses[1]["exchange_outcomes"]  # type: ignore[index]
        print(f"n0 refused {statuses[0]['rejected_payloads']}; n1's exchanges {outcomes}")  # type: ignore[index]
        # n0 called n1, n1 admitted and served it, and n0 refused n1's payload: the exchange was not committed.
        assert served_at is not None and outcomes.get("not_committed", 0) >= 1, outcomes
        assert statuses[0]["rejected_payloads"].get("norm_bound", 0) >= 1  # type: ignore[index]
        for status, other in zip(statuses, reversed(ids), strict=True):
            blends = [h for h in status["history"] if h["partner"] == other]  # type: ignore[index]
            assert not blends, (status["peer_id"], blends)  # type: ignore[index]
    finally:
        stop_all(nodes)


def test_a_node_out_of_reach_is_told_the_step_its_partner_is_at(bootstrap: Bootstrap, tmp_path: Path) -> None:
    """A caller further than --max-staleness outer steps from a node learns the node's live step from the node
    itself (OUT_OF_RANGE, and the step in the trailing metadata), not only from a DHT record that may lag."""
    from noloco_node.rpc.client import ExchangeError, exchange_with
    from noloco_node.rpc.transport import Transport
    from noloco_node.wire.frames import TensorLayout

    from .attacker import fresh_identity, node_weights, payload

    node = NodeProcess("n0", bootstrap, tmp_path, *TRAIN, "--steps", "100000", "--inner-steps", "5")
    try:
        deadline = time.monotonic() + 120
        while not ((status := node.status()) and status["outer_step"] >= 6 and status["address"]):
            assert time.monotonic() < deadline, "the node did not reach outer step 6"
            time.sleep(0.3)
        weights = node_weights(seq_len=64)
        caller = fresh_identity()
        outgoing = payload(weights, run_fingerprint=status["run_fingerprint"], peer_id=caller.peer_id, outer_step=1)
        layout = [TensorLayout(name, tuple(t.shape)) for name, t in weights]
        try:
            exchange_with(
                status["address"],
                outgoing,
                layout,
                run_fingerprint=status["run_fingerprint"],
                max_payload_bytes=1 << 30,
                timeout=20,
                peer=status["peer_id"],
                transport=Transport(identity=caller),
            )
        except ExchangeError as refused:
            assert refused.reason == "out_of_reach" and "outer step" in str(refused), refused
            assert refused.peer_outer_step is not None and refused.peer_outer_step >= 6, refused.peer_outer_step
        else:
            raise AssertionError("a caller 5 outer steps behind was served")
    finally:
        stop_all([node])
