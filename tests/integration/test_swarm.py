"""Real swarms on loopback: a bootstrap peer and node processes that discover each other, exchange and learn."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from noloco_node.algorithm import noloco_pair_step
from noloco_node.config.models import DataConfig, TrainConfig, model_config_for
from noloco_node.data.corpus import ReplicaShard, load_corpus
from noloco_node.model.source import SeededDecoder
from noloco_node.node.fault_injection import Drill
from noloco_node.node.launch import EXIT_GRACE_SECONDS
from noloco_node.observability.ledger import build_ledger, read_receipt_files
from noloco_node.rpc.client import UNACKNOWLEDGED
from noloco_node.security.identity import KEY_FILE, NodeIdentity
from noloco_node.wire import quantize

from .swarm_harness import Bootstrap, NodeProcess, stop_all
from .throttling_proxy import ThrottlingProxy, free_port

TRAIN = ["--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "4"]


def test_three_nodes_discover_each_other_exchange_and_learn(bootstrap: Bootstrap, tmp_path: Path) -> None:
    nodes = [
        NodeProcess(
            f"node{i}",
            bootstrap,
            tmp_path,
            *TRAIN,
            "--steps",
            "200",
            "--inner-steps",
            "20",
            "--shard-index",
            str(i),
            "--pair-timeout",
            "5",
            # Launched together, they start together: a node whose process started late joined in progress with 5
            # outer steps of history under a loaded machine, and this test is about the three training side by side.
            "--wait-for-peers",
            "2",
        )
        for i in range(3)
    ]
    try:
        codes = [node.wait(timeout=300) for node in nodes]
        assert codes == [0, 0, 0], "\n".join(node.output()[-2000:] for node in nodes)
        peer_ids = set()
        for node in nodes:
            status = node.status()
            assert status is not None and status["health"]["state"] == "finished"
            peer_ids.add(status["peer_id"])
            history = status["history"]
            assert history[-1]["inner_step"] == 200 and len(history) >= 7  # 10 outer steps; a catch-up may skip some
            partners = [h["partner"] for h in history if h["partner"]]
            assert len(partners) >= 3, f"{node.name} blended only {len(partners)} times"
            assert len(set(partners)) == 2, f"{node.name} always blended with the same peer: pairs do not mix"
            assert status["exchange_outcomes"].get("completed", 0) >= 1 or status["bytes_received"] > 0
            first, last = history[0]["val_loss"], history[-1]["val_loss"]
            assert last < first - 0.3 and last < math.log(256) - 2
        for node in nodes:  # every partner is another node of this swarm
            assert {h["partner"] for h in node.status()["history"] if h["partner"]} <= peer_ids - {
                node.status()["peer_id"]
            }
        # Each blend left a receipt both partners signed: the ledger rebuilt from the receipts alone (the real
        # command, over the three data directories) credits each member with the blends its own status counted.
        ledger = subprocess.run(
            [sys.executable, "-m", "noloco_node", "contributions", "--json", *(str(n.data_dir) for n in nodes)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        members = {m["peer_id"]: m for m in json.loads(ledger.stdout)["members"]}
        for node in nodes:
            status = node.status()
            blends = sum(1 for h in status["history"] if h["partner"])
            # Only an acknowledgement lost in flight credits more: the server blended and kept the receipt, and
            # this node, in doubt, stepped alone (its `unacknowledged` exchanges; docs/security.md).
            credited, in_doubt = (
                members[status["peer_id"]]["blends"],
                status["exchange_outcomes"].get(UNACKNOWLEDGED, 0),
            )
            assert blends <= credited <= blends + in_doubt, (node.name, members, status["receipts"])
            assert members[status["peer_id"]]["tokens"] == credited * 20 * 8 * 64  # H x batch x sequence, per blend
            assert status["receipts"].get("kept", 0) >= blends and set(status["receipts"]) == {"kept"}
        assert json.loads(ledger.stdout)["refused"] == {} and json.loads(ledger.stdout)["closed_clusters"] == []
        # A member that lost its data directory but kept its key (docs/security.md): the same peer id, and its
        # partners' copies of the receipts alone still credit it with every blend.
        restored = tmp_path / "restored"
        restored.mkdir()
        shutil.copy2(nodes[0].data_dir / KEY_FILE, restored / KEY_FILE)
        first = nodes[0].status()
        assert NodeIdentity.load_or_create(restored).peer_id == first["peer_id"]
        others = build_ledger(read_receipt_files([n.data_dir for n in nodes[1:]]))
        assert others.members[first["peer_id"]].blends == members[first["peer_id"]]["blends"]
    finally:
        stop_all(nodes)


@pytest.mark.parametrize(
    ("mode", "wire_dtype", "blend_momenta"), [("sync", "fp32", True), ("stream", "int8", False)], ids=str
)
def test_two_nodes_blend_exactly_as_the_algorithm_says(
    bootstrap: Bootstrap, tmp_path: Path, mode: str, wire_dtype: str, blend_momenta: bool
) -> None:
    """Each node's checkpointed phi/delta equal noloco_pair_step on the tensors the two nodes held, as the wire
    delivers them, replayed here step for step.

    sync in fp32 with --blend-momenta, two outer steps: node1 steps 4x slower (a drill), so node0 trains on while it
    waits at the first (--train-while-waiting, the steps borrowed from the next phase) and blends its fresher theta
    with node1's as sent, while both compute the mean momentum from the thetas they *sent* (``sent_theta``); at
    the second both have reached --steps and send what they hold. stream in int8, one outer step: phi swapped in
    bf16 during the phase, the progress theta - phi through the int8 codec (wire/quantize.py) at the outer step,
    and the partner's theta rebuilt from both in fp32."""
    threads = torch.get_num_threads()
    total = 20 if mode == "sync" else 10
    args = [
        *TRAIN,
        "--steps",
        str(total),
        "--inner-steps",
        "10",
        "--wire-dtype",
        wire_dtype,
        "--mode",
        mode,
        *(["--blend-momenta"] if blend_momenta else []),
        "--pair-timeout",
        "30",
        # A stream node whose phase found no partner waits --alone-grace for a late phase swap: the two nodes may
        # start training a second apart (--wait-for-peers polls), longer than a 10-step phase, so wait long enough.
        "--alone-grace",
        "30",
        "--wait-for-peers",
        "1",
        "--torch-threads",
        str(threads),
        "--num-shards",
        "2",
        "--seed",
        "5",
        *("--device", "cpu"),  # the replay below is on the CPU: a GPU's phases would differ in their last bits
    ]
    slow = Drill(slow_factor=4.0).environment() if mode == "sync" else None
    nodes = [
        NodeProcess(f"node{i}", bootstrap, tmp_path, *args, "--shard-index", str(i), env=slow if i == 1 else None)
        for i in range(2)
    ]
    try:
        assert [node.wait(timeout=300) for node in nodes] == [0, 0], nodes[0].output()[-2000:]
    finally:
        stop_all(nodes)
    statuses = [node.status() for node in nodes]
    histories = [status["history"] for status in statuses]
    assert [len(h) for h in histories] == [total // 10] * 2
    for i, history in enumerate(histories):
        assert all(h["partner"] == statuses[1 - i]["peer_id"] for h in history), history
    waited = [[h["steps_while_waiting"] for h in history] for history in histories]
    if mode == "sync":
        # What this test is for: node0 blended a theta newer than the one it sent.
        assert waited[0][0] > 0, waited

    # Replay each node's phases here (same seed, shard and thread count: bit-identical), with the steps each took
    # while waiting, then blend as the wire delivered.
    corpus = load_corpus(DataConfig())
    train_cfg = TrainConfig(
        model_size="tiny",
        seq_len=64,
        batch_size=8,
        total_steps=total,
        inner_steps=10,
        seed=5,
        eval_batches=4,
        device="cpu",
    )
    model_cfg = SeededDecoder(model_config_for("tiny", vocab_size=256, max_seq_len=64), seed=5)
    from noloco_node.training.loop import InnerLoop
    from noloco_node.training.replica import Replica

    torch.set_num_threads(threads)
    replicas, phases = [], []
    for shard_index in range(2):
        shard = ReplicaShard(corpus.train, replica=shard_index, num_replicas=2, seq_len=64, seed=5)
        replica = Replica(model_cfg, train_cfg, [shard])
        replicas.append(replica)
        phases.append(InnerLoop(replica, total_steps=total, inner_steps=10).phases())
    for outer in range(total // 10):
        sent = []
        for i, replica in enumerate(replicas):
            next(phases[i])  # the phase the node ran (less the steps it borrowed for it at the last outer step)
            sent.append([t.clone() for t in replica.fast_weights()])
            for _ in range(waited[i][outer]):
                replica.train_step()
        blended = []
        for i, replica in enumerate(replicas):
            partner = replicas[1 - i]
            partner_theta = sent[1 - i]
            if mode == "stream":
                phi_seen = [p.to(torch.bfloat16).to(torch.float32) for p in partner.phi]
                progress = [t - p for t, p in zip(partner_theta, partner.phi, strict=True)]
                progress_seen = [
                    quantize.dequantize(quantize.quantize(d, wire_dtype), d.numel(), wire_dtype).view_as(d)
                    for d in progress
                ]
                partner_theta = [p + d for p, d in zip(phi_seen, progress_seen, strict=True)]
            received = (
                (partner_theta, list(partner.phi), list(partner.delta)) if blend_momenta else (partner_theta, [], [])
            )
            blended.append(
                noloco_pair_step(
                    replica.fast_weights(),
                    replica.phi,
                    replica.delta,
                    received,
                    alpha=0.5,
                    beta=0.7,
                    gamma=0.7,
                    blend_momenta=blend_momenta,
                    sent_theta=sent[i] if waited[i][outer] else None,
                )
            )
        for replica, (new_phi, new_delta) in zip(replicas, blended, strict=True):
            replica.apply_outer_step(new_phi, new_delta)
    for i, replica in enumerate(replicas):
        saved = torch.load(nodes[i].data_dir / "checkpoint.pt", weights_only=True)["replica"]
        assert saved["outer_step"] == total // 10
        for name, got, want in zip(saved["param_names"], saved["phi"], replica.phi, strict=True):
            assert torch.equal(got, want), f"phi of {name} on node {i}"
        for name, got, want in zip(saved["param_names"], saved["delta"], replica.delta, strict=True):
            assert torch.equal(got, want), f"delta of {name} on node {i}"


def test_a_peer_killed_mid_exchange_costs_the_survivor_one_round(bootstrap: Bootstrap, tmp_path: Path) -> None:
    """Both nodes are reachable only through slow proxies, so an exchange streams for seconds; the victim is
    killed with SIGKILL while bytes are flowing. The survivor must log it, blend with nothing from that exchange,
    and keep training to the end."""
    import signal
    import threading

    survivor_port, victim_port = free_port(), free_port()
    killed = threading.Event()
    victim_holder: list[NodeProcess] = []
    orphans: list[int] = []

    def kill_victim_mid_stream(relayed: int) -> None:
        if relayed > 150_000 and not killed.is_set() and victim_holder:
            killed.set()
            orphans.extend(victim_holder[0].descendants())
            victim_holder[0].process.send_signal(signal.SIGKILL)

    # fp32 tiny model: ~490 kB per payload, at 150 kB/s an exchange streams for about 3 seconds.
    survivor_proxy = ThrottlingProxy(survivor_port, bytes_per_second=150_000, on_bytes=kill_victim_mid_stream)
    victim_proxy = ThrottlingProxy(victim_port, bytes_per_second=150_000, on_bytes=kill_victim_mid_stream)
    common = [
        *TRAIN,
        "--inner-steps",
        "20",
        "--wire-dtype",
        "fp32",
        "--pair-timeout",
        "8",
        "--exchange-timeout",
        "20",
        "--num-shards",
        "2",
        # Neither trains before the other is live: a victim that starts a second late would otherwise download the
        # survivor's state as a joiner, and be killed in that download instead of in an exchange.
        "--wait-for-peers",
        "1",
    ]
    survivor = NodeProcess(
        "survivor",
        bootstrap,
        tmp_path,
        *common,
        "--steps",
        "120",
        "--shard-index",
        "0",
        "--grpc-port",
        str(survivor_port),
        "--announce-port",
        str(survivor_proxy.port),
    )
    victim = NodeProcess(
        "victim",
        bootstrap,
        tmp_path,
        *common,
        "--steps",
        "120",  # a run-wide setting: the same as the survivor's, or the two are in different runs
        "--shard-index",
        "1",
        "--grpc-port",
        str(victim_port),
        "--announce-port",
        str(victim_proxy.port),
    )
    victim_holder.append(victim)
    try:
        assert survivor.wait(timeout=400) == 0, survivor.output()[-3000:]
        assert killed.is_set(), "no exchange ever streamed through the proxies"
        assert victim.process.wait(timeout=10) == -signal.SIGKILL
        # Its DHT helper process and p2pd die with it instead of running on, orphaned.
        assert len(orphans) >= 2, orphans
        deadline = time.monotonic() + 15
        while (alive := [pid for pid in orphans if Path(f"/proc/{pid}").exists()]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive, f"processes of the SIGKILLed node still running: {alive}"
    finally:
        survivor.stop()
        victim.stop()
        survivor_proxy.close()
        victim_proxy.close()
    status = survivor.status()
    assert status["health"]["state"] == "finished"
    history = status["history"]
    assert len(history) == 6 and history[-1]["inner_step"] == 120  # it trained to the end
    assert all(h["partner"] is None for h in history), "the survivor blended with a payload from the killed peer"
    # The one exchange that completed is the meeting that reserved the pair (pairing/sync.py): a few hundred
    # bytes, long before 150 kB had crossed; the weights exchange it led to was cut.
    assert status["exchange_outcomes"].get("completed", 0) == 1
    assert status["exchange_outcomes"].get("failed", 0) + status["exchange_outcomes"].get("aborted", 0) >= 1
    assert "failed" in survivor.output() or "did not arrive whole" in survivor.output()


def test_overlap_mode_blends_without_waiting_for_partners(bootstrap: Bootstrap, tmp_path: Path) -> None:
    # The three train together (--wait-for-peers), in steps of 100 ms: tiny's own steps take a few ms, and a run of
    # 200 was over before a node that came up 3 s late had started (it then trained alone). Not 50 ms: a node sees
    # its peers' steps 1-3 s late (records read through shared lookups), the last of three to see the others starts
    # up to 2 s after them, and with phases of 1 s a node that started 3 phases behind (under the suite's load) saw
    # its peers' records alternate between within reach and beyond it, never caught up, and blended 0 times.
    drill = Drill(step_time_seconds=0.1).environment()
    nodes = [
        NodeProcess(
            f"node{i}",
            bootstrap,
            tmp_path,
            *TRAIN,
            "--mode",
            "overlap",
            "--steps",
            "200",
            "--inner-steps",
            "20",
            "--shard-index",
            str(i),
            "--num-shards",
            "3",
            "--wait-for-peers",
            "2",
            "--log-every",
            "0",
            env=drill,
        )
        for i in range(3)
    ]
    try:
        assert [node.wait(timeout=300) for node in nodes] == [0, 0, 0], nodes[0].output()[-2000:]
    finally:
        stop_all(nodes)
    for node in nodes:
        history = node.status()["history"]
        # A node that starts a moment after the others joins a run in progress (downloads their state) and so
        # has fewer outer steps of its own; every node trains to the same end.
        assert history[-1]["inner_step"] == 200 and len(history) >= 7
        blended = [h for h in history if h["partner"]]
        assert len(blended) >= 5, node.blend_report()
        # Offers are one phase old at most (the staleness bound is 2 outer steps).
        assert all(h["outer_step"] - 1 - h["partner_step"] <= 2 for h in blended)
        assert history[-1]["val_loss"] < history[0]["val_loss"] - 0.3


@pytest.mark.slow  # joiners download and train in the fast tier (test_outsider.py, test_catch_up.py): `make test-slow`
def test_a_late_joiner_trains_from_a_donors_state_and_the_donor_never_pauses(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    """The joiner starts after the others' 3rd outer step. Donors are reached through 100 kB/s proxies, so the
    0.5 MB of fp32 slow weights (all a joiner keeps, and all GetState serves) take about 5 s to download: a donor
    that paused for it would show a 5 s inner phase."""
    args = [*TRAIN, "--inner-steps", "20", "--num-shards", "3", "--pair-timeout", "3"]
    ports = [free_port(), free_port()]
    proxies = [ThrottlingProxy(port, bytes_per_second=100_000) for port in ports]
    early = [
        NodeProcess(
            f"early{i}",
            bootstrap,
            tmp_path,
            *args,
            "--steps",
            "240",
            "--shard-index",
            str(i),
            "--grpc-port",
            str(ports[i]),
            "--announce-port",
            str(proxies[i].port),
        )
        for i in range(2)
    ]
    late = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = early[0].status()
            if status and status["outer_step"] >= 4:
                break
            time.sleep(0.2)
        late = NodeProcess("late", bootstrap, tmp_path, *args, "--steps", "240", "--shard-index", "2")
        assert late.wait(timeout=300) == 0, late.output()[-3000:]
        for node in early:
            assert node.wait(timeout=120) == 0
    finally:
        stop_all([*early, *([late] if late else [])])
        for proxy in proxies:
            proxy.close()
    output = late.output()
    assert "joined a run in progress: state of outer step" in output
    joined_at = int(output.split("joined a run in progress: state of outer step")[1].split()[0])
    downloaded = float(output.split(" MB downloaded")[0].rsplit("; ", 1)[1])
    source = SeededDecoder(model_config_for("tiny", vocab_size=256, max_seq_len=64), seed=0)
    phi_mb = 4 * sum(math.prod(shape) for _, shape in source.layout()) / 1e6
    assert phi_mb - 0.001 <= downloaded < 1.1 * phi_mb  # the slow weights and their framing, nothing more
    donor_tail = output.split("joined a run in progress: state of outer step")[1].split()[2][:8]
    assert joined_at >= 3
    late_history = late.status()["history"]
    # It resumed the run's counters, not step 0: its first phase ended outer step joined_at + 1, which the clock rule
    # may have moved on at once (the others went on while its download crossed the 100 kB/s proxy).
    first = late_history[0]
    assert (first["clock_moved_from"] or first["outer_step"]) == joined_at + 1, first
    assert late_history[-1]["inner_step"] == 240
    donor = next(node for node in early if node.status()["peer_id"].endswith(donor_tail))
    donor_history = {h["outer_step"]: h for h in donor.status()["history"]}
    fresh_first = min(node.status()["history"][0]["val_loss"] for node in early)  # one phase from scratch
    # Its first evaluation is the donor's level, far below what a fresh model reaches in one phase.
    assert late_history[0]["val_loss"] <= donor_history[joined_at]["val_loss"] + 0.1
    assert late_history[0]["val_loss"] < fresh_first - 0.5
    # The donor kept training while it served: no inner phase of it stalled for the 5 s download.
    phases = [h["train_seconds"] for h in donor_history.values()]
    assert max(phases) < 3.0, phases


def test_a_partner_frozen_mid_exchange_holds_no_thread_past_the_nodes_last_step(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    """The partner is frozen (SIGSTOP) while bytes of an exchange are flowing: its socket stays open and says
    nothing, so a call to it blocks until its deadline (20 s here) unless its waiter ends it. The node trains on
    alone and leaves with no thread held: none for the exit's backstop to report, and none that held its leave."""
    import signal
    import threading

    steps = 160
    node_port, partner_port = free_port(), free_port()
    frozen = threading.Event()
    partner_holder: list[NodeProcess] = []

    last_look = [0.0]

    def freeze_partner_mid_stream(relayed: int) -> None:
        # In an exchange after the node's second outer step: the node trains on alone past the frozen call.
        if relayed < 150_000 or frozen.is_set() or not partner_holder or time.monotonic() - last_look[0] < 0.2:
            return
        last_look[0] = time.monotonic()
        if (node.status() or {}).get("outer_step", 0) >= 2:
            frozen.set()
            partner_holder[0].process.send_signal(signal.SIGSTOP)

    node_proxy = ThrottlingProxy(node_port, bytes_per_second=150_000, on_bytes=freeze_partner_mid_stream)
    partner_proxy = ThrottlingProxy(partner_port, bytes_per_second=150_000, on_bytes=freeze_partner_mid_stream)
    # 8 outer steps: the node's run outlasts the partner's start (--wait-for-peers starts the node once the
    # partner's record is up, and a loaded machine can take seconds more to start the partner's training: a run of
    # 4 outer steps once ended before the partner's first).
    common = [*TRAIN, "--inner-steps", "20", "--wire-dtype", "fp32", "--steps", str(steps), "--num-shards", "2"]
    common += ["--pair-timeout", "8", "--exchange-timeout", "20", "--wait-for-peers", "1"]
    node = NodeProcess(
        "node", bootstrap, tmp_path, *common, "--shard-index", "0", "--grpc-port", str(node_port),
        "--announce-port", str(node_proxy.port),
    )  # fmt: skip
    partner = NodeProcess(
        "partner", bootstrap, tmp_path, *common, "--shard-index", "1", "--grpc-port", str(partner_port),
        "--announce-port", str(partner_proxy.port),
    )  # fmt: skip
    partner_holder.append(partner)
    try:
        assert node.wait(timeout=400) == 0, node.output()[-3000:]
        exited = time.time()
        assert frozen.is_set(), "no exchange ever streamed through the proxies"
        history = node.status()["history"]
        assert history[-1]["inner_step"] == steps  # it trained to the end
        # A thread held on the frozen partner holds the leave: the loop's close joins its executor's threads, and the
        # exit's backstop waits EXIT_GRACE_SECONDS for any other before naming it. A leave that waits on neither
        # takes the server's grace and the process's teardown (2-6 s on a loaded 2-core machine).
        assert exited - history[-1]["time"] < EXIT_GRACE_SECONDS, exited - history[-1]["time"]
        assert "still running" not in node.output(), node.output()[-3000:]
    finally:
        if partner.process.poll() is None:
            partner.process.send_signal(signal.SIGCONT)
        node.stop()
        partner.stop()
        node_proxy.close()
        partner_proxy.close()


def test_sigterm_leaves_gracefully_checkpoints_and_withdraws_the_record(bootstrap: Bootstrap, tmp_path: Path) -> None:
    import asyncio
    import signal
    import time

    from noloco_node.discovery.dht import Discovery

    nodes = [
        NodeProcess(
            f"node{i}",
            bootstrap,
            tmp_path,
            *TRAIN,
            "--steps",
            "100000",
            "--inner-steps",
            "20",
            "--shard-index",
            str(i),
            "--num-shards",
            "2",
        )
        for i in range(2)
    ]
    observer = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            statuses = [node.status() for node in nodes]
            if all(s and s["outer_step"] >= 2 for s in statuses):
                break
            time.sleep(0.2)
        fingerprint = statuses[0]["run_fingerprint"]
        ids = [s["peer_id"] for s in statuses]
        observer = Discovery(fingerprint, initial_peers=bootstrap.maddrs)
        observer.start()

        async def visible() -> set[str]:
            return {r.peer_id for r in await observer.live_peers()}

        assert asyncio.run(visible()) >= set(ids)
        nodes[1].process.send_signal(signal.SIGTERM)
        asked = time.monotonic()
        assert nodes[1].wait(timeout=60) == 0
        # Bounded: the current step, a pairing wait cut short, checkpoint, tombstone, servers down. With
        # millisecond exchanges that is a few seconds; the 30 s bound leaves room for a loaded machine.
        assert time.monotonic() - asked < 30
        leaver = nodes[1].status()
        saved = torch.load(nodes[1].data_dir / "checkpoint.pt", weights_only=True)["replica"]
        assert saved["inner_step"] == leaver["inner_step"] >= 40  # the final checkpoint is the last state
        seen = asyncio.run(visible())
        assert ids[1] not in seen and ids[0] in seen  # tombstoned at once, not left to expire
    finally:
        if observer is not None:
            observer.shutdown()
        stop_all(nodes)


def test_a_data_dir_of_another_run_is_refused_by_name(tmp_path: Path) -> None:
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    def node(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "noloco_node", "--log-level", "ERROR", *args, "--seq-len", "64"]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)

    def another_runs_checkpoint() -> subprocess.CompletedProcess[str]:
        """A checkpoint `train` wrote, then a node of a run told to use its directory."""
        data_dir = str(tmp_path / "node")
        assert node("train", "--checkpoint-dir", data_dir, "--steps", "2").returncode == 0
        return node("join", "--data-dir", data_dir, "--steps", "10")

    def own_checkpoint_with_another_setting() -> subprocess.CompletedProcess[str]:
        """A node's own checkpoint, resumed with a run-wide setting changed."""
        args = (
            "--data-dir",
            str(tmp_path / "joined"),
            "--inner-steps",
            "5",
            "--warmup-steps",
            "2",
            "--status-port",
            "0",
        )
        assert node("join", *args, "--steps", "10").returncode == 0
        return node("join", *args, "--steps", "20")

    with ThreadPoolExecutor(2) as pool:  # two independent pairs of runs
        other_run, other_setting = (
            case.result()
            for case in [pool.submit(another_runs_checkpoint), pool.submit(own_checkpoint_with_another_setting)]
        )
    assert other_run.returncode == 2, other_run.stderr[-2000:]
    assert "checkpoint.pt belongs to run" in other_run.stderr and "use another --data-dir" in other_run.stderr
    # The message names the setting.
    assert other_setting.returncode == 2, other_setting.stderr[-2000:]
    assert "(total_steps 10 (now: 20))" in other_setting.stderr, other_setting.stderr[-2000:]


def test_a_node_left_out_of_reach_catches_up_and_blends_again(bootstrap: Bootstrap, tmp_path: Path) -> None:
    """A node that starts from the seed while the others are beyond --max-staleness ahead (here: told not to
    download at start) trains as fast as they do, so it would stay out of their reach for good. After three solo
    steps it downloads a peer's state, then pairs with them."""
    args = [*TRAIN, "--inner-steps", "10", "--num-shards", "3", "--pair-timeout", "3", "--steps", "100000"]
    early = [NodeProcess(f"early{i}", bootstrap, tmp_path, *args, "--shard-index", str(i)) for i in range(2)]
    behind = None
    try:
        _wait_until(lambda: min(_outer_step(node) for node in early) >= 8, 120, "the early nodes' 8th outer step")
        behind = NodeProcess("behind", bootstrap, tmp_path, *args, "--shard-index", "2", "--no-download-state")
        _wait_until(lambda: _blends(behind) >= 3, 120, "three blends of the node that was behind")
        output = behind.output()
        assert "every live peer is" in output and "caught up with the swarm: state of outer step" in output
        history = behind.status()["history"]
        caught_up = int(output.split("caught up with the swarm: state of outer step")[1].split()[0])
        assert history[0]["outer_step"] == 1 and caught_up >= 8  # it started from the seed, and jumped ahead
        early_ids = {node.status()["peer_id"] for node in early}
        assert {h["partner"] for h in history if h["partner"]} <= early_ids
    finally:
        stop_all([*early, *([behind] if behind else [])])


def test_an_overlap_node_a_few_phases_behind_catches_up_though_its_peers_records_lag(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    """Overlap mode, phases of 1 s: the late node is held after its first inner step until its peer's 4th outer step,
    so it trains 3-4 phases behind, at the same pace, just beyond --max-staleness (2). The peer's records reach it
    1-3 s late; read from the status watch's lookups alone, they showed the peer within reach at most steps, the node
    never caught up, and it blended 0 times (CI). Pairing's own lookups now feed the node's view (pairing/caller.py),
    as in every mode: after three solo steps it downloads a state, and then blends. When the clock rule moves the late
    node's first step on, it trains 2-3 phases behind: its peer is exactly --max-staleness ahead at the node's own
    steps and beyond reach for most of each phase, which counts as out of reach (it once counted as within, 3 runs in
    14, and the node never caught up)."""
    release = tmp_path / "release"
    args = [*TRAIN, "--mode", "overlap", "--steps", "300", "--inner-steps", "20", "--num-shards", "2"]
    args += ["--wait-for-peers", "1", "--log-every", "0"]
    ahead = NodeProcess(
        "ahead", bootstrap, tmp_path, *args, "--shard-index", "0", env=Drill(step_time_seconds=0.05).environment()
    )
    held = Drill(step_time_seconds=0.05, hold_after_inner_step=1, release_file=str(release))
    late = NodeProcess("late", bootstrap, tmp_path, *args, "--shard-index", "1", env=held.environment())
    try:
        _wait_until(lambda: _outer_step(ahead) >= 4, 120, "the first node's 4th outer step")
        release.touch()
        assert late.wait(timeout=300) == 0, late.output()[-3000:]
    finally:
        stop_all([ahead, late])
    output = late.output()
    assert "every live peer is" in output and "caught up with the swarm: state of outer step" in output, output[-3000:]
    caught_up = int(output.split("caught up with the swarm: state of outer step")[1].split()[0])
    after = [h for h in late.status()["history"] if h["outer_step"] > caught_up]
    assert after and sum(1 for h in after if h["partner"]) >= len(after) - 1, late.blend_report()


def _outer_step(node: NodeProcess) -> int:
    status = node.status()
    return status["outer_step"] if status else 0


def _blends(node: NodeProcess) -> int:
    status = node.status()
    return sum(1 for h in status["history"] if h["partner"]) if status else 0


def _wait_until(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)
