"""The outer step and its upkeep as a share of the phase, read from a local swarm's histories (figures.sh swarm).

Usage: python3 benchmarks/gpu/outer_share.py SWARM_DIR [RSS_FILE]

Per node and outer step: the phase's training time, the wait for the partner, the outer step's own work (movement,
blend and loss check, evaluation: ``blend_seconds``) and the upkeep (snapshot, checkpoint: ``upkeep_seconds``).
The share is (own work + upkeep) / training, the median over the node's outer steps and over all of them. The
first outer step is listed apart: it allocates the reused buffers. RSS_FILE: peak resident memory samples (KiB).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from noloco_node.observability.status_file import read_status_document


def main(folder: Path, rss: Path | None) -> None:
    for node in sorted(folder.glob("node*/")):
        status = read_status_document(node)
        if not status or not status.get("history"):
            print(f"{node.name}: no history")
            continue
        history = status["history"]
        plan = status.get("step_plan") or {}
        shown = ("micro_batch", "accumulation", "compiled", "outer_state_on_device", "tokens_per_second", "mfu")
        print(f"{node.name}: plan {', '.join(f'{key} {plan.get(key)}' for key in shown)}")
        shares = []
        for entry in history:
            own = entry["blend_seconds"] + entry["upkeep_seconds"]
            share = own / max(entry["train_seconds"], 1e-9)
            shares.append(share)
            print(
                f"  outer step {entry['outer_step']}: train {entry['train_seconds']:.1f} s "
                f"({entry['phase_steps']} steps), wait {entry['wait_seconds']:.2f} s, outer step "
                f"{entry['blend_seconds']:.3f} s, upkeep {entry['upkeep_seconds']:.3f} s: {share:.2%} of the phase; "
                f"partner {str(entry['partner'])[-8:]}, val {entry['val_loss']:.3f}"
            )
        later = shares[1:] or shares
        print(f"  share of the phase: median {statistics.median(later):.2%} after the first, all {shares}")
    if rss is not None and rss.exists():
        samples = [int(line) for line in rss.read_text().split() if line.strip().isdigit()]
        if samples:
            print(f"largest node's peak resident memory: {max(samples) / 2**20:.1f} GiB ({len(samples)} samples)")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
