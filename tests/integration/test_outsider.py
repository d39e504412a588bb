"""One outsider against real node processes: each attack that once stopped a swarm's learning, poisoned a member or
crashed a node, and what the node does about it now (docs/threat-model.md). The outsider (noloco_bench/
outsider.py) holds no secret and no honest key; it comes from 127.0.0.2 where it holds connections, as an
outsider on the internet comes from an address of its own. The replayed membership proof (attack 6) is in
test_security.py, with the private run it needs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
import pytest

from noloco_bench.fake_donors import FakeDonor
from noloco_bench.outsider import (
    Target,
    download_phi,
    forged_payload,
    fresh_identity,
    hostile_progress_once,
    ratchet,
)
from noloco_node.config.models import model_config_for
from noloco_node.config.node_config import SecurityConfig
from noloco_node.rpc.client import fetch_info
from noloco_node.rpc.transport import Transport

from .swarm_harness import Bootstrap, NodeProcess, run_attacker, stop_all, wait_for_steps_after

TRAIN = ["--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2"]
MODEL = model_config_for("tiny", vocab_size=256, max_seq_len=64)


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _live(status: dict) -> dict:
    with urllib.request.urlopen(f"{status['status_url']}/status", timeout=10) as answer:
        return json.loads(answer.read())


def _target(status: dict) -> Target:
    return Target(status["peer_id"], status["address"], status["run_fingerprint"], status["outer_step"])


def _blends_with(node: NodeProcess, partner_id: str, after: float) -> int:
    return sum(1 for h in node.status()["history"] if h["partner"] == partner_id and h["time"] > after)


def _far_front(output: str) -> str | None:
    """A log line that took the fake front (outer step 1,000,000) for real: "999976 outer steps behind", "clock
    moved ... to 1000000". These runs never reach outer step 1000 (a loss like 1.9999 is no such line)."""
    found = re.search(r"\b\d{4,} outer steps|outer step \d{4,}\b|moved from outer step \d+ to \d{4,}", output)
    return found.group(0) if found else None


def test_a_forged_payload_is_refused_and_the_real_peer_keeps_blending(bootstrap: Bootstrap, tmp_path: Path) -> None:
    args = [*TRAIN, "--steps", "100000", "--inner-steps", "10", "--pair-timeout", "5"]
    nodes = [NodeProcess(f"n{i}", bootstrap, tmp_path, *args, "--shard-index", str(i)) for i in range(2)]
    try:
        a, b = (
            _wait_for(lambda n=n: (s := n.status()) and s["address"] and s["outer_step"] >= 1 and s, 120, n.name)
            for n in nodes
        )
        attacked = time.time()
        # Garbage in b's name, under the outsider's own valid proof, several times: refused each time.
        for _ in range(3):
            code, details = forged_payload(a["address"], _target(_live(a)), MODEL, b["peer_id"], fresh_identity())
            assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
        # b is not quarantined: the two keep blending with each other.
        _wait_for(lambda: _blends_with(nodes[0], b["peer_id"], attacked) >= 3, 90, "blends of a with b")
        _wait_for(lambda: _blends_with(nodes[1], a["peer_id"], attacked) >= 3, 90, "blends of b with a")
        assert _live(a)["rejected_payloads"].get("spoofed_peer_id") == 3
    finally:
        stop_all(nodes)


def test_the_norm_bound_is_not_ratcheted_from_a_cold_start_nor_after_a_restart(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    args = [*TRAIN, "--steps", "100000", "--inner-steps", "10", "--mode", "overlap", "--checkpoint-every", "1"]
    node = NodeProcess("target", bootstrap, tmp_path, *args)
    outsider = fresh_identity()

    def attack() -> tuple[dict, dict[str, list[str]], dict]:
        status = _wait_for(
            lambda: (s := node.status()) and s["address"] and s["outer_step"] >= 1 and s, 120, "one phase"
        )
        before = _live(status)
        target = _target(before)
        phi = download_phi(target, MODEL, outsider)
        codes = ratchet(status["address"], target, MODEL, phi)
        return before, codes, _live(status)

    def own_bound(status: dict) -> float:
        """3 x the largest movement of the last 8 phases: as it was, or per unit of learning rate at the partners'
        largest rate."""
        last = [h for h in status["history"][-8:] if h["movement"]]
        per_lr = max(h["movement"] / h["phase_lr"] for h in last) * status["history"][-1]["partner_lr"]
        return min(0.9, 3.0 * max(per_lr, max(h["movement"] for h in last)))

    def live_bound_and_own(status: dict) -> tuple[float, float]:
        """The live bound and the one its own history gives. The node takes a phase's movement into its bound
        before pairing, and the phase enters the history only after the blend and the evaluation: a document read
        in between holds a bound one phase ahead of its history (seen: 0.00855 against 0.00735, and 0.00614
        against 0.00735 when the window's largest movement had just left it). So this reads the live status again,
        for at most 5 s, until the two agree: a bound that does not come from the node's own movements never
        agrees with them."""
        deadline = time.monotonic() + 5.0
        while True:
            document = _live(status)
            bound, own = document["security"]["norm_bound"], own_bound(document)
            if bound == pytest.approx(own, rel=1e-6) or time.monotonic() > deadline:
                return bound, own
            time.sleep(0.02)

    try:
        before, codes, after = attack()
        assert before["security"]["norm_bound_basis"] == "own_movement"
        # Random and scaled weights never get in, whatever the payloads before them did.
        assert codes["random"] == ["INVALID_ARGUMENT"] and codes["scaled_3x"] == ["INVALID_ARGUMENT"], codes
        # The bound is this node's own movement times 3: the payloads at 0.95 moved it by nothing.
        bound, own = live_bound_and_own(after)
        assert bound == pytest.approx(own, rel=1e-6)
        assert codes["ratchet_0.95"] == ["INVALID_ARGUMENT"] * 3, codes  # beyond the ceiling, from the start
        node.stop()
        (node.data_dir / "status.json").unlink()  # the next status read is the restarted process's
        # After a restart the bound comes back from the checkpoint at once: no window of a loose bound.
        node = NodeProcess("target", bootstrap, tmp_path, *args)
        restarted = _wait_for(lambda: (s := node.status()) and s["history"] and s, 120, "the restarted node")
        assert restarted["security"]["norm_bound_basis"] == "own_movement", restarted["security"]
        bound, own = live_bound_and_own(restarted)
        assert bound == pytest.approx(own, rel=1e-6)
        _, codes, after = attack()
        assert codes["random"] == ["INVALID_ARGUMENT"] and codes["scaled_3x"] == ["INVALID_ARGUMENT"], codes
        bound, own = live_bound_and_own(after)
        assert bound == pytest.approx(own, rel=1e-6)
    finally:
        node.stop()


def test_a_progress_past_a_tensors_bound_is_refused_and_one_within_every_bound_is_judged_by_what_it_does(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    """Stream mode, int8: a fresh key swaps a phase payload with the node (the node's own phi, from GetState), then
    delivers a crafted progress at the node's outer step.

    - One that spends 0.97 of the node's overall bound on the smallest tensor (an attention output projection: about
      3% of the model's norm, so it moves by about 32 times the bound) is refused by that tensor's own bound, though
      the overall check alone took it. Not 0.8 of the bound: that tensor's own movement can be 2.9 times the overall
      bound, and its bound, three times three times that, took 0.8 of the allowance (0.543 against 0.56).
    - One that shrinks every tensor by 0.85 of the bound, once the node's loss falls slowly (from its 40th outer step:
      early in a run the check allows a blend twice what the loss fell per outer step lately), passes every bound and
      is taken by the exchange, and the loss check refuses to blend it (node/blend_check.py): the step is solo and
      its history shows both candidates' losses. At the second such refusal the key is set aside: it gets no phase
      swap then, when a fresh key's is taken at once.
    """
    from dataclasses import replace

    import torch

    from noloco_bench.outsider import phase_frames, swap_once
    from noloco_node.security.identity import NodeIdentity
    from noloco_node.security.payload_guard import relative_norm

    args = [*TRAIN, "--steps", "100000", "--inner-steps", "20", "--mode", "stream", "--wire-dtype", "int8"]
    # A bound 20 times the node's movement, not 3: a shrink inside it then costs the blend more than the loss check
    # allows (inside the default bound, 0.06 there, a shrink at 0.85 of it was within the allowance and not refused).
    bound_factor = ["--norm-bound-factor", "20"]
    node = NodeProcess(
        "target", bootstrap, tmp_path, *args, *bound_factor, "--pair-timeout", "5", "--avoid-seconds", "120"
    )

    def attack(progress_of, key: NodeIdentity, from_step: int) -> tuple[tuple[str, str], float, float]:
        """Until the key's swap lands in a phase (a phase of 20 steps may end while it is in flight): what the swap
        and the progress got, the progress's overall size relative to phi, and the node's bound then."""
        for _ in range(20):
            wanted = f"{from_step} phases"
            status = _live(_wait_for(lambda: (s := node.status()) and s["outer_step"] >= from_step and s, 120, wanted))
            target = _target(status)
            phi = download_phi(target, MODEL, key)
            now = fetch_info(target.address, timeout=5, peer_id=target.peer_id).outer_step
            target = replace(target, outer_step=now)
            progress = progress_of(phi, status["security"]["norm_bound"])
            got = hostile_progress_once(target.address, target, MODEL, key, phi, progress, wire_dtype="int8")
            if got[1] != "not_sent":
                return got, relative_norm(progress, phi), status["security"]["norm_bound"]
        raise AssertionError(f"no swap landed: {got}")

    def on_the_smallest_tensor(phi: list[torch.Tensor], bound: float) -> list[torch.Tensor]:
        norms = [float(t.float().norm()) for t in phi]
        smallest = norms.index(min(norms))
        whole = sum(n * n for n in norms) ** 0.5
        progress = [torch.zeros_like(t, dtype=torch.float32) for t in phi]
        progress[smallest] = -phi[smallest].float() * (0.97 * bound * whole / norms[smallest])
        return progress

    def shrink_within_bound(phi: list[torch.Tensor], bound: float) -> list[torch.Tensor]:
        return [-0.85 * bound * t.float() for t in phi]

    def phase_swap(key: NodeIdentity) -> str:
        target = _target(_live(node.status()))
        now = fetch_info(target.address, timeout=5, peer_id=target.peer_id).outer_step
        target = replace(target, outer_step=now)
        phi = download_phi(target, MODEL, key)
        return swap_once(target.address, target, key, phase_frames(target, MODEL, key.peer_id, phi, "bf16"))

    try:
        (swapped, delivered), size, bound = attack(on_the_smallest_tensor, fresh_identity(), 2)
        assert swapped == "committed" and delivered == "INVALID_ARGUMENT", (swapped, delivered)
        assert size < bound, (size, bound)  # the overall distance alone admits it
        output = node.output()
        refusal = re.search(r"refused norm_bound from \w+: \S+ from \w+ is [\d.]+ \(relative L2 of that", output)
        assert refusal and "o_proj" in refusal.group(0), output[-3000:]

        turned = fresh_identity()
        for strike in (1, 2):  # the loss check's strikes (payload_admission.py): set aside at the second
            (swapped, delivered), size, bound = attack(shrink_within_bound, turned, 40)
            assert (swapped, delivered) == ("committed", "committed"), (strike, swapped, delivered)  # in every bound

            def refused(strikes: int = strike) -> bool:
                return _live(node.status())["rejected_payloads"].get("loss_check") == strikes

            _wait_for(refused, 60, f"refusal {strike} by the loss check")
        assert f"refused loss_check from {turned.peer_id}" in node.output()
        live = _live(node.status())
        judged = [h for h in live["history"] if h["loss_with_partner"] is not None and h["partner"] is None]
        assert len(judged) == 2 and all(h["val_loss"] == h["loss_alone"] for h in judged), judged
        assert all(h["loss_with_partner"] > h["loss_alone"] for h in judged), judged
        assert all(h["partner"] != turned.peer_id for h in live["history"]), "a refused blend counts as a blend"
        # Set aside for --avoid-seconds: no phase of the node's is swapped with that key, a fresh one's is.
        first_try = _live(node.status())["outer_step"]
        while _live(node.status())["outer_step"] < first_try + 3:  # through three of its phases
            assert phase_swap(turned) != "committed"
        assert _wait_for(lambda: phase_swap(fresh_identity()) == "committed", 30, "a fresh key's phase swap")
    finally:
        node.stop()


# The corroborated donor's test below keeps a joiner and a restarting member among donors in the fast tier;
# bench outsider runs this fake donor with every other attack: `make test-slow`.
@pytest.mark.slow
def test_a_fake_donor_is_adopted_neither_by_a_joiner_nor_by_a_restarting_member(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    args = [*TRAIN, "--steps", "100000", "--inner-steps", "10", "--pair-timeout", "3", "--checkpoint-every", "1"]
    member = NodeProcess("member", bootstrap, tmp_path, *args, "--shard-index", "0")
    peer = NodeProcess("peer", bootstrap, tmp_path, *args, "--shard-index", "1")
    donor = None
    others: list[NodeProcess] = []
    try:
        status = _wait_for(lambda: (s := member.status()) and s["outer_step"] >= 3 and s, 120, "member at step 3")
        donor = FakeDonor(bootstrap.maddrs, status["run_fingerprint"], MODEL, inner_steps=10)  # plausible counters
        # The member restarts from its good checkpoint with an honest peer and the fake donor in sight: the front
        # two peers agree on is the honest one's, so it never believes itself a million steps behind.
        member.stop()
        (member.data_dir / "status.json").unlink()
        member = NodeProcess("member", bootstrap, tmp_path, *args, "--shard-index", "0")
        back = _wait_for(
            lambda: (
                (s := member.status()) and s["history"] and s["history"][-1]["outer_step"] > status["outer_step"] and s
            ),
            120,
            "the member training again",
        )
        output = member.output()
        assert "resumed from" in output and not _far_front(output)
        if "joined a run in progress" in output:  # a few steps behind the honest peer: its state, measured first
            assert donor.identity.peer_id[-8:] not in output.split("joined a run in progress")[1].splitlines()[0]
        assert back["outer_step"] < 1000
        # While the member was down, the honest peer was alone with the fake donor's record, a million steps ahead:
        # its catch-up (docs/churn.md, "Left behind") may have downloaded that state and refused it (its counters
        # are past --steps; were they not, its weights measure worse).
        lured = donor.served
        refusals = [line for line in peer.output().splitlines() if "refused the state" in line]
        assert lured == 0 or any(donor.identity.peer_id in line for line in refusals), refusals
        logs = peer.output() + member.output()
        assert not any(
            f"{how}: state of outer step 1000000" in logs
            for how in ("caught up with the swarm", "joined a run in progress")
        )
        # A fresh joiner with all three in sight downloads from an honest node, never from the fake donor.
        joiner = NodeProcess("joiner", bootstrap, tmp_path, *args, "--shard-index", "2")
        others.append(joiner)
        _wait_for(lambda: "joined a run in progress" in joiner.output(), 120, "the joiner's download")
        line = joiner.output().split("joined a run in progress")[1].splitlines()[0]
        assert donor.identity.peer_id[-8:] not in line and donor.served == lured, line
        # Alone with the fake donor (every honest node gone), a joiner has only its record to go on: it downloads
        # the state, refuses it (counters past --steps) and starts from the run's seed.
        stop_all([member, peer, joiner])
        alone = NodeProcess("alone", bootstrap, tmp_path, *args, "--shard-index", "3")
        others.append(alone)
        first = _wait_for(lambda: (s := alone.status()) and s["history"] and s, 120, "the lone joiner's first step")
        assert f"refused the state from {donor.identity.peer_id}: implausible counters" in alone.output()
        assert first["history"][0]["outer_step"] == 1 and donor.served >= 1
    finally:
        stop_all([member, peer, *others])
        if donor is not None:
            donor.close()


def test_a_corroborated_poisoned_donor_harms_neither_a_joiner_nor_a_restarting_member(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    """Two free keys on two outsider addresses (two network groups against the honest nodes' one) claim outer step
    1,000,000 with counters consistent with that claim, and serve the freshest honest slow weights (which measure
    well). Once, a joiner and a restarting member took them: past --steps, they reported finished and left. Now the
    restarting member has its standing back from its checkpoint and believes only its honest peer, and a joiner
    refuses counters at or past --steps (then downloads from the honest peer); no adopted state carries a donor's
    moments anyway (unit: test_a_donors_state_gives_...)."""
    args = [*TRAIN, "--steps", "100000", "--inner-steps", "10", "--pair-timeout", "3", "--warmup-steps", "10"]
    args += ["--standing-seconds", "3"]  # the two honest nodes have standing with each other before the attack
    member = NodeProcess("member", bootstrap, tmp_path, *args, "--shard-index", "0")
    peer = NodeProcess("peer", bootstrap, tmp_path, *args, "--shard-index", "1")
    donors: list[FakeDonor] = []
    others: list[NodeProcess] = []
    try:
        status = _wait_for(lambda: (s := member.status()) and s["outer_step"] >= 3 and s, 120, "member at step 3")
        honest = lambda: _target(peer.status())  # noqa: E731 - the freshest honest state, read when asked
        donors = [
            FakeDonor(bootstrap.maddrs, status["run_fingerprint"], MODEL, host=host, honest=honest, inner_steps=10)
            for host in ("127.0.0.2", "127.0.0.3")
        ]
        fakes = {donor.identity.peer_id for donor in donors}
        _wait_for(
            lambda: fakes <= {p["peer_id"] for p in (peer.status() or {}).get("peers", [])}, 60, "the donors' records"
        )
        # What this test is about: a member that had standing with its peer keeps it through its restart.
        _wait_for(lambda: _live(member.status())["security"]["established_peers"] >= 1, 60, "the member's standing")
        member.stop()
        (member.data_dir / "status.json").unlink()
        member = NodeProcess("member", bootstrap, tmp_path, *args, "--shard-index", "0")
        joiner = NodeProcess("joiner", bootstrap, tmp_path, *args, "--shard-index", "2")
        others.append(joiner)
        target = peer.status()["outer_step"] + 8  # type: ignore[index]

        def evaluated_at_target() -> list[float] | None:
            """Each node's validation loss at its first outer step from ``target`` on (evaluated there, not one a
            jump of its counters carried over)."""
            losses = []
            for node in (member, joiner, peer):
                history = (node.status() or {}).get("history", [])
                reached = [h["val_loss"] for h in history if h["outer_step"] >= target and h["val_loss"]]
                if not reached:
                    return None
                losses.append(reached[0])
            return losses

        losses = _wait_for(evaluated_at_target, 180, f"every node evaluated at outer step {target}")
        print(f"validation loss member {losses[0]:.4f}, joiner {losses[1]:.4f}, honest peer {losses[2]:.4f}")
        logs = member.output() + joiner.output()
        assert "state of outer step 1000000" not in logs and not _far_front(member.output())
        assert "joined a run in progress" in joiner.output() and "resumed from" in member.output()
        assert all(n.process.poll() is None for n in (member, joiner)), "a node took the donors' counters and ended"
        # No worse than 5% above the honest node (the poison, once adopted, left both above the seed's 5.5).
        assert max(losses[:2]) <= 1.05 * losses[2], losses
    finally:
        stop_all([member, peer, *others])
        for donor in donors:
            donor.close()


@pytest.mark.slow  # two 20 s attack windows; the fast tier cuts a slow-loris in test_security: `make test-slow`
def test_a_lock_hog_and_slot_exhaustion_leave_honest_nodes_blending_and_answering(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    """The outsider runs as a process of its own at the lowest CPU priority: on these shared 2 cores it stands
    for a host of its own, and what is measured is what it does to the nodes, not the CPU it burns."""
    args = [*TRAIN, "--steps", "100000", "--inner-steps", "20", "--pair-timeout", "10"]
    nodes = [NodeProcess(f"n{i}", bootstrap, tmp_path, *args, "--shard-index", str(i)) for i in range(2)]
    try:
        statuses = [
            _wait_for(lambda n=n: (s := n.status()) and s["address"] and s["outer_step"] >= 2 and s, 120, n.name)
            for n in nodes
        ]
        # A hog that got in holds a node's round until the stall limit cuts it, and its address is then barred for
        # 30 s: one hold per node per 30 s window. With two nodes a held node's partner has nobody else, so each hold
        # costs the swarm about the stall limit: 2 holds x 2 s of 30 s, about 13% of the window's blends. The blend
        # count also moves with the shared CPU (inner steps took 17-30 ms in 5 s slices of one window with no
        # attack), so its ratio to a window with no attack measured 0.78-1.12 in runs where every defence worked.
        # What is asserted instead is what the defences promise, per outer step, from the nodes' own history:
        # - none waited longer than the two nodes' holds together: the watchdog checks every 0.5 s, so it cuts a
        #   hold 2-3 s after the last byte, and the two holds may follow each other (2.1-3.0 s measured here,
        #   against at most 0.44 s in windows with no attack); an uncut hog holds the round to --pair-timeout (10 s
        #   here, clear of the two holds) and the step goes alone;
        # - none went alone;
        # - the bar let the hog in at most once per node per window (20 s, inside the 30 s bar).
        window = 20.0
        longest_cut_hold = SecurityConfig().stall_seconds + 2 * 0.5  # Watchdog(tick=0.5)
        wait_bound = len(nodes) * longest_cut_hold + 1.0  # and a second to pair again

        def steps_in(start: float, end: float) -> list[dict]:
            """Both nodes' outer steps in the window (the status keeps each node's last 200: enough)."""
            return [h for n in nodes for h in n.status()["history"] if start < h["time"] <= end]

        def attack(attacks: str, source: str) -> tuple[list[dict], dict]:
            started, seen = run_attacker(
                "noloco_bench.outsider", nodes, window, "--attacks", attacks, "--source", source
            )
            # Its window starts after its own start-up, and a step it held may end after it exits: every outer step
            # that ended from its start until the step in progress at its exit ended is counted.
            wait_for_steps_after(nodes, time.time())
            return steps_in(started, time.time()), seen

        # The lock hog alone (from an address of its own): a valid manifest, then silence, again and again.
        hogged, hog_seen = attack("hog", "127.0.0.3")
        # Then the hog and ten silent streams per node, from another address.
        flooded, seen = attack("hog,silent", "127.0.0.2")

        def summary(steps: list[dict]) -> str:
            blended = sum(1 for h in steps if h["partner"])
            longest = max((h["wait_seconds"] for h in steps), default=0.0)
            return f"{blended}/{len(steps)} outer steps blended, longest wait {longest:.2f} s"

        print(
            f"while the outsider ran ({window:.0f} s of attack): under the lock hog {summary(hogged)}; under "
            f"the hog and the silent streams {summary(flooded)}; the outsider saw {hog_seen} and {seen}"
        )
        for steps, name in ((hogged, "hog"), (flooded, "hog and silent streams")):
            # They kept training through it (the two nodes took 200-240 outer steps in a 30 s window here).
            assert len(steps) >= 40, (name, len(steps))
            alone = [h for h in steps if not h["partner"]]
            assert len(alone) <= 0.05 * len(steps), (name, summary(steps), alone)
            held = [h for h in steps if h["wait_seconds"] > wait_bound]
            assert not held, (name, wait_bound, held)
        # It tried: a hog got the round and was cut, at most once per node (the bar), and the call it made the moment
        # it was cut was refused. With the silent streams from the same address, their cuts usually bar it before the
        # hog gets in.
        for report in (hog_seen, seen):
            cuts = report["hogs"].get("CANCELLED", 0)
            assert cuts <= len(nodes), report
            assert report["after_cut"] == ({"RESOURCE_EXHAUSTED": cuts} if cuts else {}), report
        assert hog_seen["hogs"].get("CANCELLED", 0) >= 1, hog_seen
        assert seen["silent"].get("CANCELLED", 0) >= 1 and seen["silent"].get("RESOURCE_EXHAUSTED", 0) >= 10, seen
        probes = Counter(hog_seen["probes"]) + Counter(seen["probes"])
        answered = sum(v for k, v in probes.items() if k.endswith(" OK"))
        assert sum(probes.values()) > 40 and answered >= 0.95 * sum(probes.values()), probes
        live = _live(statuses[0])
        assert live["rejected_payloads"].get("admission_barred", 0) > 0, live["rejected_payloads"]
        assert all(n.process.poll() is None for n in nodes)
    finally:
        stop_all(nodes)


@pytest.mark.slow
def test_a_key_that_reserves_each_phase_and_never_delivers_holds_one_phase_per_set_aside(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    """Stream mode, sparse wire: the outsider reserves each of both nodes' phases with an empty phase swap (one key
    per node, no DHT record) and never sends a progress. Each node waits for the reserved partner once, sets the key
    aside (undelivered) and refuses its swaps from then on: within the attack window (shorter than the 30 s set
    aside) each key holds at most one phase of each node, and the nodes keep blending with each other. Before the
    set-aside, such a key held every phase it reserved and the node stepped alone at every one."""
    args = [*TRAIN, "--steps", "100000", "--inner-steps", "10", "--pair-timeout", "3"]
    args += ["--mode", "stream", "--wire-dtype", "sparse"]
    nodes = [NodeProcess(f"n{i}", bootstrap, tmp_path, *args, "--shard-index", str(i)) for i in range(2)]
    try:
        for n in nodes:
            _wait_for(lambda n=n: (s := n.status()) and s["address"] and s["outer_step"] >= 2 and s, 120, n.name)
        window = 20.0
        started, seen = run_attacker(
            "noloco_bench.outsider", nodes, window, "--attacks", "reserve", "--wire-dtype", "sparse"
        )
        wait_for_steps_after(nodes, time.time())
        ended = time.time()
        steps = {n.name: [h for h in n.status()["history"] if started < h["time"] <= ended] for n in nodes}
        lives = [_live(n.status()) for n in nodes]
    finally:
        stop_all(nodes)
    summary = {name: f"{sum(1 for h in hs if h['partner'])}/{len(hs)} blended" for name, hs in steps.items()}
    print(f"under the reserving key ({window:.0f} s): {summary}; the outsider saw {seen['reservations']}")
    assert 1 <= seen["reservations"].get("reserved", 0) <= len(nodes), seen  # it got in, once per node at most
    for live in lives:
        assert live["exchange_outcomes"].get("undelivered", 0) <= 1, live["exchange_outcomes"]
    honest = {n["peer_id"] for n in lives}
    for name, hs in steps.items():
        assert len(hs) >= 10, (name, len(hs))
        with_honest = sum(1 for h in hs if h["partner"] in honest)
        assert with_honest >= 0.7 * len(hs), (name, summary)


HOLD_IDLE_CONNECTIONS = """
import sys, time
from noloco_bench.outsider import idle_connections
held = idle_connections(sys.argv[1], int(sys.argv[2]))
print(len(held), flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


@pytest.mark.slow  # a descriptor soak: `make test-slow` (docs/testing.md)
def test_two_thousand_idle_connections_under_a_1024_descriptor_limit_do_not_stop_the_node(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    node = NodeProcess(
        "target",
        bootstrap,
        tmp_path,
        *TRAIN,
        "--steps",
        "100000",
        "--inner-steps",
        "10",
        "--checkpoint-every",
        "1",
        open_files=1024,
    )
    holders: list[subprocess.Popen[str]] = []
    try:
        status = _wait_for(lambda: (s := node.status()) and s["address"] and s["outer_step"] >= 1 and s, 120, "start")
        flood_start = time.time()
        checkpoint = node.data_dir / "checkpoint.pt"
        # Two processes of 1,000 connections each: neither needs more than a plain shell's 1,024 descriptors.
        for _ in range(2):
            holders.append(
                subprocess.Popen(
                    [sys.executable, "-c", HOLD_IDLE_CONNECTIONS, status["address"], "1000"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        assert [int(h.stdout.readline()) for h in holders] == [1000, 1000]

        def trained_and_checkpointed_under_the_flood() -> bool:
            assert node.process.poll() is None, node.output()[-3000:]
            during = node.status()
            # it trained on, two outer steps at least, and checkpointed at least 5 s into the flood
            return (
                bool(during)
                and during["outer_step"] >= status["outer_step"] + 2
                and (checkpoint.exists() and checkpoint.stat().st_mtime > flood_start + 5)
            )

        _wait_for(trained_and_checkpointed_under_the_flood, 60, "training and a checkpoint under 2,000 connections")
        for holder in holders:
            holder.communicate(timeout=30)  # closing its stdin ends it, and with it its connections
        # Its server answers again once the idle connections are gone.
        transport = Transport(identity=fresh_identity())
        reply = _wait_for(lambda: _try_info(status, transport), 30, "an Info answer after the flood")
        assert reply.peer_id == status["peer_id"]
        assert node.process.poll() is None
        assert "Too many open files" not in node.output()
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
        node.stop()


def _try_info(status: dict, transport: Transport):
    try:
        return fetch_info(status["address"], timeout=5, transport=transport, peer_id=status["peer_id"])
    except Exception:
        return None
