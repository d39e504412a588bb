"""The host memory a node needs for its model, and the warning at start when this machine has less.

A node holds, per parameter (fp32 unless said): the fast weights theta, their gradients and Adam's two moments
(16 bytes; on a GPU these live in GPU memory), the slow weights phi and outer momentum delta (8 bytes, on the host
unless the step plan keeps them on the GPU, which the start check does not yet know: it counts them here; arXiv
2506.10911 eq. 3-5 need both), the snapshot of the outer state (phi, delta, moments: 16 bytes) that serves
GetState and the checkpoint writer while the trainer goes on (training/checkpoints.py; renewed in its own buffers
at each outer step, wire/published.py), and a second one while a reader of the last one spans an outer step (a
download, or a checkpoint write slower than a phase), and the exchange's offer and receive buffers in the wire
dtype (about 4 bytes). docs/data-and-models.md has the measured figures and what sizes fit where.

Nothing is refused on this estimate (swap, or memory freed by other processes, may make it fit); a node that will
not fit says so at start, with the numbers, instead of being killed at its first step (node/doctor.py, whose
checks `join` prints at start).
"""

from __future__ import annotations

from pathlib import Path

GIB = 2**30
DEVICE_BYTES = 16  # theta, gradients, Adam's two moments
OUTER_BYTES = 8  # phi, delta
SNAPSHOT_BYTES = 2 * 16  # the snapshot, and a second while a reader spans an outer step
EXCHANGE_BYTES = 4  # offer and receive buffers (bf16 each way)


def host_bytes_per_parameter(on_gpu: bool) -> int:
    """Host bytes per parameter of a node whose model trains on the CPU, or on a GPU (theta gathered on the host)."""
    trained_here = 4 if on_gpu else DEVICE_BYTES  # on a GPU only a host copy of theta for the exchange
    return trained_here + OUTER_BYTES + SNAPSHOT_BYTES + EXCHANGE_BYTES


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), in bytes; None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
