"""A local swarm, the main job: a bootstrap peer and N `noloco-node join` processes on 127.0.0.1.

Each node is a separate process with one torch thread (on a GPU, its share of the host's cores), its own data
directory and its own shard of the corpus; they find each other only through the DHT and exchange only over gRPC,
exactly as machines on the internet would.
The launcher shows progress while they train, forwards Ctrl-C (SIGTERM to every node, so each leaves gracefully),
and writes a summary with every node's validation loss.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from noloco_node.launcher.local_swarm import LocalSwarm
from noloco_node.observability.status_file import read_status_document as read_status


def _progress_line(statuses: list[dict[str, Any] | None]) -> str:
    cells = []
    for i, status in enumerate(statuses):
        if not status or not status.get("history"):
            cells.append(f"node{i}: starting")
            continue
        last = status["history"][-1]
        blends = sum(1 for h in status["history"] if h["partner"])
        cells.append(f"node{i}: outer {last['outer_step']:3d} val {last['val_loss']:.3f} blends {blends}")
    return " | ".join(cells)


def summarize(out_dir: Path, num_nodes: int) -> dict[str, Any]:
    statuses = [read_status(out_dir / f"node{i}") for i in range(num_nodes)]
    names = {s["peer_id"]: f"node{i}" for i, s in enumerate(statuses) if s and s.get("peer_id")}
    nodes = []
    for i, status in enumerate(statuses):
        if not status or not status.get("history"):
            nodes.append({"node": f"node{i}", "outer_steps": 0})
            continue
        history = status["history"]
        nodes.append(
            {
                "node": f"node{i}",
                "peer_id": status["peer_id"],
                "health": str(status["health"]["state"]),
                "status_url": status["status_url"],
                "inner_steps": status["inner_step"],
                "outer_steps": status["outer_step"],
                "first_val_loss": history[0]["val_loss"],
                "final_val_loss": history[-1]["val_loss"],
                "final_val_ppl": math.exp(history[-1]["val_loss"]),
                "blends": sum(1 for h in history if h["partner"]),
                # Whom it blended with, and how often: NoLoCo mixes by pairing with a random peer every outer step,
                # so a swarm of fixed pairs shows here as one partner taking every blend.
                "partners": dict(Counter(names.get(h["partner"], h["partner"]) for h in history if h["partner"])),
                "solo_steps": sum(1 for h in history if not h["partner"]),
                "wait_seconds": sum(h["wait_seconds"] for h in history),
                "train_seconds": sum(h["train_seconds"] for h in history),
                # The outer steps' own work and their upkeep (snapshot, checkpoint), beside the phases' training.
                "outer_step_seconds": sum(h.get("blend_seconds", 0.0) + h.get("upkeep_seconds", 0.0) for h in history),
                "bytes_sent": status["bytes_sent"],
                "bytes_received": status["bytes_received"],
                "rejected": status["rejected_payloads"],
            }
        )
    return {"nodes": nodes}


def spread(partners: dict[str, int]) -> str:
    """``node1 5, node2 4`` (most first), or ``-``."""
    return ", ".join(f"{name[-8:]} {count}" for name, count in Counter(partners).most_common()) or "-"


def summary_table(summary: dict[str, Any]) -> str:
    rows = [
        "| node | outer steps | val loss (first -> final) | ppl | blends | solo | partners | waited s | sent MB |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for n in summary["nodes"]:
        if not n.get("outer_steps"):
            rows.append(f"| {n['node']} | 0 | - | - | - | - | - | - | - |")
            continue
        rows.append(
            f"| {n['node']} | {n['outer_steps']} | {n['first_val_loss']:.3f} -> {n['final_val_loss']:.3f} | "
            f"{n['final_val_ppl']:.2f} | {n['blends']} | {n['solo_steps']} | {spread(n['partners'])} | "
            f"{n['wait_seconds']:.1f} | "
            f"{n['bytes_sent'] / 1e6:.1f} |"
        )
    return "\n".join(rows)


def run_swarm(
    num_nodes: int, out_dir: Path, node_args: Sequence[str], *, progress_every: float = 2.0, resume: bool = False
) -> int:
    """Run the swarm to the end of training (or Ctrl-C); returns 0 when every node exited cleanly.

    A previous swarm's files in ``out_dir`` are replaced, unless ``resume``: then each node resumes from its
    checkpoint there (a finished run stays finished).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    previous_run = [path for path in out_dir.glob("node*") if path.is_dir()]
    if previous_run and not resume:
        print(f"replacing the previous swarm in {out_dir}/ (--resume continues it instead)", flush=True)
        for path in previous_run:
            shutil.rmtree(path)
        for path in [*out_dir.glob("node*.log"), out_dir / "summary.json"]:
            path.unlink(missing_ok=True)
    interrupted = False

    def on_interrupt(_signum: int, _frame: object) -> None:
        nonlocal interrupted
        interrupted = True

    previous = signal.signal(signal.SIGINT, on_interrupt)
    swarm = LocalSwarm(out_dir, num_nodes, list(node_args))
    try:
        print(f"bootstrap peer: {swarm.maddrs[0]}", flush=True)
        print(
            f"{num_nodes} nodes started; logs and checkpoints in {out_dir}/ (Ctrl-C stops them gracefully)", flush=True
        )
        last_line, last_print = "", 0.0
        while swarm.running() and not interrupted:
            line = _progress_line([swarm.status(slot) for slot in swarm.slots])
            if line != last_line and time.monotonic() - last_print >= progress_every:
                print(line, flush=True)
                last_line, last_print = line, time.monotonic()
            time.sleep(0.5)
        if interrupted:
            print("stopping the swarm: SIGTERM to every node", flush=True)
    finally:
        codes = swarm.stop(timeout=60)
        signal.signal(signal.SIGINT, previous)
    summary = summarize(out_dir, num_nodes)
    summary["exit_codes"] = codes
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(summary_table(summary))
    print(f"\nsummary: {out_dir / 'summary.json'}; exit codes {codes}")
    return 0 if all(code == 0 for code in codes) else 1
