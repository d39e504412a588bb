"""The snapshot and the checkpoints made from it, off the trainer.

The *snapshot* is the node's outer state at its last outer step (theta == phi there), copied once into reused
buffers (:class:`Snapshots`): phi, delta and Adam's two moments, with the counters, the data positions and the RNG.
It is the one name for that copy (wire/published.py holds it as ``LatestSnapshot``). That one
:class:`~noloco_node.wire.published.Published` copy serves every reader, none of which touches
the live replica:

- a joiner's ``GetState`` streams it (rpc/state_serving.py), for as long as the stream takes;
- the norm check measures a partner's payload against its phi and delta (node/payload_admission.py);
- the :class:`CheckpointWriter` thread turns it into a checkpoint and writes it (``torch.save``, fsync, rename)
  while the trainer is already in its next inner phase.

A checkpoint is the replica's full state (Replica.state_dict's format), so a node resumes bit-exactly: from an
outer step's snapshot, or, when the node stops mid-phase, from the live state the stopped trainer leaves behind.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from noloco_node.model.checkpoint_file import save_checkpoint
from noloco_node.model.source import ModelSource
from noloco_node.training.replica import Replica
from noloco_node.wire.published import BufferPool, Published

log = logging.getLogger(__name__)

# The snapshot's tensors, each prefix over every parameter: what a checkpoint is made of. GetState serves the first
# part alone (STATE_PREFIX): a joiner keeps a donor's slow weights and rebuilds the rest (Replica.adopt_donor_weights).
SNAPSHOT_PREFIXES = ("phi", "delta", "adam.exp_avg", "adam.exp_avg_sq")
STATE_PREFIX = SNAPSHOT_PREFIXES[0]


def state_layout(source: ModelSource) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of what GetState serves and a joiner downloads: the slow weights at an outer step."""
    return [(f"{STATE_PREFIX}/{name}", shape) for name, shape in source.layout()]


class Snapshots:
    """Takes the replica's snapshot into reused buffers (one per outer step), by the trainer."""

    def __init__(self, replica: Replica) -> None:
        shapes = [tuple(p.shape) for p in replica.params] * len(SNAPSHOT_PREFIXES)
        self.names = [f"{prefix}/{name}" for prefix in SNAPSHOT_PREFIXES for name in replica.names]
        self.pool = BufferPool(shapes, torch.float32, pinned=replica.device.type == "cuda")

    def take(self, replica: Replica) -> Published:
        """Trainer thread, at an outer step: the copy (the caller holds it; ``release`` it when superseded)."""
        exp_avg, exp_avg_sq, steps = replica.adam_moments()
        moments = {
            name: [
                value if value is not None else torch.zeros(param.shape)
                for value, param in zip(values, replica.params, strict=True)
            ]
            for name, values in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq))
        }
        adam_step = int(max((s for s in steps if s is not None), default=0))
        metadata: dict[str, Any] = {
            "counters": {"inner_step": replica.inner_step, "outer_step": replica.outer_step, "adam_step": adam_step},
            "adam_steps": steps,
            "param_groups": replica.optimizer.state_dict()["param_groups"],
            "data_positions": [shard.position for shard in replica.shards],
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "param_names": list(replica.names),
        }
        return self.pool.publish(
            [*replica.phi, *replica.delta, *moments["exp_avg"], *moments["exp_avg_sq"]], metadata=metadata
        )

    def served(self, copy: Published) -> list[tuple[str, torch.Tensor]]:
        """The part of a snapshot that GetState serves (the slow weights), named as state_layout names them."""
        return list(zip(self.names, copy.tensors, strict=False))[: len(copy.tensors) // len(SNAPSHOT_PREFIXES)]


def replica_state_of(copy: Published) -> dict[str, Any]:
    """A snapshot in Replica.state_dict's format (theta == phi at an outer step), for a checkpoint."""
    meta = copy.metadata
    count = len(meta["param_names"])
    phi, delta, exp_avg, exp_avg_sq = (copy.tensors[i * count : (i + 1) * count] for i in range(4))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for index, step in enumerate(meta["adam_steps"]):
        if step is not None:
            state[index] = {"step": torch.tensor(step), "exp_avg": exp_avg[index], "exp_avg_sq": exp_avg_sq[index]}
    return {
        "param_names": meta["param_names"],
        "theta": phi,
        "phi": phi,
        "delta": delta,
        "optimizer": {"state": state, "param_groups": meta["param_groups"]},
        "inner_step": meta["counters"]["inner_step"],
        "outer_step": meta["counters"]["outer_step"],
        "data_positions": meta["data_positions"],
        "rng_cpu": meta["rng_cpu"],
        "rng_cuda": meta["rng_cuda"],
    }


class CheckpointWriter:
    """Writes checkpoints on its own thread, so that the trainer never waits for ``torch.save`` or fsync.

    One write at a time, and at most one waiting: a checkpoint submitted while another waits replaces it (the
    newest state wins, and a slow disk costs skipped checkpoints, never a slower trainer). ``submit`` takes a
    function that builds the payload on the writer thread and one that runs when the write is done (it releases
    the snapshot the payload was built from).
    """

    def __init__(self, path: Path, *, on_written: Callable[[], None] = lambda: None) -> None:
        self.path = path
        self.on_written = on_written
        self._cond = threading.Condition()
        self._pending: tuple[Callable[[], dict[str, Any]], Callable[[], None]] | None = None
        self._busy = False
        self._closed = False
        self.written = 0
        self.superseded = 0  # submitted but replaced by a newer one before it was written
        self.last_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)

    def start(self) -> None:
        """Start the writer thread (a node starts it after the DHT has forked its helper process)."""
        self._thread.start()

    def submit(self, build: Callable[[], dict[str, Any]], done: Callable[[], None] = lambda: None) -> None:
        with self._cond:
            if self._closed:
                done()
                raise RuntimeError("the checkpoint writer is closed")
            if self._pending is not None:
                self._pending[1]()
                self.superseded += 1
            self._pending = (build, done)
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted is written; False if ``timeout`` ran out first."""
        if self._thread.ident is None:
            self.start()  # nothing can be written before the thread runs
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout=timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Write what is pending, then stop the thread; False if that took longer than ``timeout``."""
        flushed = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return flushed and not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                (build, done), self._pending = self._pending, None
                self._busy = True
            try:
                save_checkpoint(self.path, build())
                self.written += 1
                self.on_written()
            except Exception as error:  # a full disk must be visible, and must not kill the thread
                self.last_error = error
                log.exception("could not write the checkpoint %s", self.path)
            finally:
                done()
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
