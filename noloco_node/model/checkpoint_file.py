"""The checkpoint file: one ``torch.save``'d dict with a format number, written atomically, read tensors-only.

What goes in it is training's business (training/checkpoints.py: the replica's full state, the run's identity,
the history); ``export`` and ``eval`` read the weights and the model source back from it. It lives here, below
both, because the file is all that the two share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from noloco_node.atomic_files import write_atomically

CHECKPOINT_FORMAT = 1


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write atomically (atomic_files.py): a crash leaves the previous checkpoint or the new one, never a torn file."""
    write_atomically(path, lambda handle: torch.save({"format": CHECKPOINT_FORMAT, **payload}, handle))


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The dict a checkpoint holds; ``weights_only``: a checkpoint from elsewhere cannot run code when read."""
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {payload.get('format')!r}")
    return payload
