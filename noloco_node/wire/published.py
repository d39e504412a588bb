"""Copy-on-publish: what a node hands to other threads is a copy that nobody writes while anyone reads it.

The rule (docs/architecture.md, "Who owns which tensor"): the trainer thread is the only writer of the live
replica (theta, phi, delta, Adam's moments) and writes it only inside an inner step or an outer step. Every other
thread (a gRPC handler streaming an exchange or a state download, this node's own exchange calls, the checkpoint
writer, the norm check of a partner's payload) reads only a :class:`Published` copy. A Published is complete
before anyone sees it, never written afterwards, and reference-counted: its buffers go back to their
:class:`BufferPool` for the next copy only when the last holder has released it. So the trainer publishes the
next outer step's copy while a slow partner is still streaming the last one, and a stream can never send a
tensor that the outer step is overwriting.

Buffers are reused from one outer step to the next (no allocation on the training path once warm); a pool keeps
at most ``keep`` idle sets and allocates a new one only while every set it has is still held by a reader.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from noloco_node.wire import peer_pb2 as pb


class Published:
    """An immutable copy of some tensors (with the manifest that describes them, when they are sent), shared by
    reference count. The publisher holds the first reference and releases it when it publishes the next one."""

    def __init__(
        self,
        pool: BufferPool | None,
        tensors: list[torch.Tensor],
        *,
        manifest: pb.Manifest | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self._pool = pool
        self.tensors = tensors
        self.manifest = manifest if manifest is not None else pb.Manifest()
        self.metadata = metadata or {}
        self._lock = threading.Lock()
        self._refs = 1

    @property
    def holders(self) -> int:
        with self._lock:
            return self._refs

    def hold(self) -> bool:
        """Take a reference for reading; False when the copy was already given back (read nothing then)."""
        with self._lock:
            if self._refs == 0:
                return False
            self._refs += 1
            return True

    def release(self) -> None:
        with self._lock:
            if self._refs == 0:
                raise RuntimeError("a published copy was released more often than it was held")
            self._refs -= 1
            free = self._refs == 0
        if free and self._pool is not None:
            self._pool.recycle(self.tensors)


class BufferPool:
    """Reused sets of buffers of fixed shapes for :class:`Published` copies (thread-safe)."""

    def __init__(
        self,
        shapes: Sequence[tuple[int, ...]],
        dtype: torch.dtype,
        *,
        pinned: bool = False,
        keep: int = 2,
        encode: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> None:
        self.shapes = [tuple(shape) for shape in shapes]
        self.dtype = dtype
        # encode(buffer, source) writes a source into a buffer of another shape (a quantized wire dtype's bytes);
        # without it a source is copied into a buffer of its own shape, converted to the pool's dtype.
        self.encode = encode
        self.pinned = pinned
        self.keep = keep
        self._lock = threading.Lock()
        self._idle: list[list[torch.Tensor]] = []
        self.allocated = 0  # buffer sets ever allocated: stays small when readers release in time

    def publish(
        self,
        sources: Sequence[torch.Tensor],
        *,
        manifest: pb.Manifest | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Published:
        """Copy ``sources`` (converted to the pool's dtype) into an idle buffer set; the caller holds the result."""
        if len(sources) != len(self.shapes):
            raise ValueError(f"{len(sources)} tensors for a pool of {len(self.shapes)}")
        buffers = self._take()
        for buffer, source in zip(buffers, sources, strict=True):
            if self.encode is not None:
                self.encode(buffer, source)
                continue
            if tuple(source.shape) != buffer.shape:
                self.recycle(buffers)
                raise ValueError(f"a tensor of shape {tuple(source.shape)} for a buffer of shape {tuple(buffer.shape)}")
            buffer.copy_(source.detach(), non_blocking=self.pinned)
        if self.pinned and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # complete before any other thread reads it
        return Published(self, buffers, manifest=manifest, metadata=metadata)

    def _take(self) -> list[torch.Tensor]:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self.allocated += 1
        return [torch.empty(shape, dtype=self.dtype, pin_memory=self.pinned) for shape in self.shapes]

    def recycle(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            if len(self._idle) < self.keep:
                self._idle.append(buffers)


class LatestSnapshot:
    """The latest published snapshot (training/checkpoints.py), renewed by its publisher at every outer step and
    held by its readers: a joiner's download, the norm check, the checkpoint writer.

    A node keeps one snapshot's buffers, not two: when nobody but this holds the latest copy at renewal, it goes
    back to its pool first, so the new copy is taken into the same buffers (16 bytes per parameter: 24 GiB at
    1.3b). Readers that ask meanwhile wait for the new copy rather than find none, since the norm check must never
    go without a state to compare with. A reader still holding the last copy (a slow download, a checkpoint being
    written) costs a second set for as long as it reads.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._current: Published | None = None
        self._renewing = False

    def renew(self, take: Callable[[], Published]) -> Published:
        """Publish ``take()``'s copy (a new reference, passed to this) as the latest and release the previous; the
        copy is returned for the publisher to read, not to release. Publisher's thread only."""
        with self._cond:
            previous, self._current = self._current, None
            self._renewing = True
        try:
            if previous is not None and previous.holders == 1:  # nobody reads it: its buffers are the new copy's
                previous.release()
                previous = None
            copy = take()
        except BaseException:
            with self._cond:
                self._current, self._renewing = previous, False
                self._cond.notify_all()
            raise
        with self._cond:
            self._current, self._renewing = copy, False
            self._cond.notify_all()
        if previous is not None:
            previous.release()
        return copy

    def hold(self) -> Published | None:
        """The latest copy, held for the caller (who releases it), or None before the first one."""
        with self._cond:
            self._cond.wait_for(lambda: not self._renewing)
            current = self._current
            if current is not None and current.hold():
                return current
        return None

    def clear(self) -> None:
        with self._cond:
            previous, self._current = self._current, None
        if previous is not None:
            previous.release()
