"""`noloco-node swarm`, the main job, as a user runs it: progress, Ctrl-C, graceful exits and a summary."""

from __future__ import annotations

import contextlib
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest


def test_swarm_runs_shows_progress_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    out = tmp_path / "swarm"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "noloco_node",
            "swarm",
            "--nodes",
            "3",
            "--out",
            str(out),
            "--steps",
            "100000",
            "--inner-steps",
            "10",
            "--seq-len",
            "64",
            "--eval-batches",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # until every node has blended twice and progress has been shown
        statuses = [out / f"node{i}" / "status.json" for i in range(3)]
        if all(p.exists() for p in statuses) and any("node0: outer" in line for line in lines):
            histories = [json.loads(p.read_text())["history"] for p in statuses]
            if all(sum(1 for h in hist if h["partner"]) >= 2 for hist in histories):
                break
        time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=120) == 0
    reader.join(timeout=10)
    output = "".join(lines)
    assert "stopping the swarm" in output and "| node0 |" in output
    assert "node0: outer" in output  # progress was shown while it ran
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_codes"] == [0, 0, 0]
    for node in summary["nodes"]:
        assert node["blends"] >= 2 and node["final_val_loss"] < node["first_val_loss"]
        # Whom it blended with, by node name, adding up to its blends; shown in the table too.
        assert sum(node["partners"].values()) == node["blends"], node["partners"]
        assert set(node["partners"]) <= {"node0", "node1", "node2"} - {node["node"]}, node["partners"]
    assert "| partners |" in output
    for i in range(3):  # each node left a final checkpoint on its way out
        assert (out / f"node{i}" / "checkpoint.pt").exists()


@pytest.mark.slow  # 60 outer steps of a swarm, about 2 minutes each: `make test-slow` (docs/testing.md)
@pytest.mark.parametrize(("nodes", "wire"), [(3, "int8"), (4, "int8"), (3, "sparse"), (4, "sparse")])
def test_an_honest_stream_swarm_blends_at_nearly_every_step_with_rotating_partners(
    tmp_path: Path, nodes: int, wire: str
) -> None:
    """Stream mode as the README recommends it, 60 outer steps: every node blends at >= 90% of the outer steps it
    took (a node that caught up with the swarm skipped some), and no partner takes more than a random choice's share
    plus 15 points (NoLoCo's convergence rests on mixing: fixed pairs are separate runs)."""
    out = tmp_path / "swarm"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "noloco_node", "swarm", "--nodes", str(nodes), "--out", str(out)),
            *("--steps", "1200", "--inner-steps", "20", "--mode", "stream", "--wire-dtype", wire),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    print(done.stdout[-1500:])
    fair_share = 1 / (nodes - 1) + 0.15
    for node in summary["nodes"]:
        taken = node["blends"] + node["solo_steps"]
        assert node["blends"] >= 0.9 * taken, node
        assert max(node["partners"].values()) <= fair_share * node["blends"], node
        assert not node["rejected"], node


def test_members_whose_records_live_in_buckets_past_level_0_find_each_other_and_blend(tmp_path: Path) -> None:
    """With buckets of two records (--bucket-records 2), 4 members read and write at level 1 (and 0 or 2 as their
    estimates lean): each lookup reads one random bucket of two (and its reserved partner's), and what a member
    knows of the swarm is its view. While they train they estimate the swarm's size, find every member, and blend at
    nearly every outer step in stream mode (whose progress exchange follows the reserved partner's bucket). Four,
    not three: a stream swarm of three has an odd node out of some phases (issue 45), which is not what this test
    is about. Not buckets of one record: their estimates are so noisy that two members' levels could be two apart,
    where neither reads a level the other writes, and a member's view could hold only itself."""
    out = tmp_path / "swarm"
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "noloco_node", "swarm", "--nodes", "4", "--out", str(out)),
            *("--steps", "240", "--inner-steps", "20", "--mode", "stream", "--wire-dtype", "int8"),
            *("--bucket-records", "2"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    seen: dict[int, list[dict]] = {index: [] for index in range(4)}  # each node's discovery, step by step
    while process.poll() is None:  # status.json is rewritten at every outer step
        for index in range(4):
            with contextlib.suppress(OSError, ValueError):
                status = json.loads((out / f"node{index}" / "status.json").read_text())
                if status.get("discovery") and 3 <= status["outer_step"] <= 11:  # mid-run: every member trains
                    seen[index].append(status["discovery"])
        time.sleep(0.5)
    assert process.wait(timeout=400) == 0
    statuses = [json.loads((out / f"node{index}" / "status.json").read_text()) for index in range(4)]
    # The outer steps each took while every member still trained: a member a moment behind the others takes its
    # last steps after they left, with nobody to blend with in any mode.
    together_until = min(status["history"][-1]["time"] for status in statuses)
    for index, status in enumerate(statuses):
        # Buckets of two records make a noisy estimate: the level moves between 0 and 2 (at 16, noise is a quarter).
        assert seen[index] and any(d["level"] >= 1 for d in seen[index]), seen[index]
        assert not any(d["probing"] for d in seen[index]) and all(d["in_view"] >= 2 for d in seen[index]), seen[index]
        assert 2 <= statistics.median(d["estimated_members"] for d in seen[index]) <= 12, seen[index]
        steps = [step for step in status["history"] if step["time"] <= together_until]
        blended = [step["partner"] for step in steps if step["partner"]]
        assert len(blended) >= 0.8 * len(steps) and len(set(blended)) >= 2, steps
