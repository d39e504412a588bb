"""Receive buffers kept from one exchange to the next (payload.py allocates from them, ``Payload.release`` gives
them back): a node exchanges at every outer step, and a fresh payload-sized buffer costs the first touch of every
page.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch


class ReceiveBuffers:
    """Receive buffers kept from one exchange to the next; thread-safe.

    A fresh payload-sized buffer costs the first touch of every one of its pages (a quarter of a loopback exchange
    at 125m), so a node keeps the buffers of its last payload (at most ``max_idle_bytes``) and reuses them.
    Buffers come back only through :meth:`Payload.release`, called by whoever consumed the payload; a payload
    never released is garbage-collected as usual.
    """

    def __init__(self, max_idle_bytes: int) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._lock = threading.Lock()
        self._idle: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self._idle_bytes = 0
        self.reused = 0

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        with self._lock:
            free = self._idle.get((dtype, numel))
            if free:
                buffer = free.pop()
                self._idle_bytes -= buffer.nbytes
                self.reused += 1
                return buffer
        return torch.empty(numel, dtype=dtype)

    def give_back(self, buffers: Sequence[torch.Tensor]) -> None:
        with self._lock:
            for buffer in buffers:
                if self._idle_bytes + buffer.nbytes > self.max_idle_bytes:
                    return
                self._idle.setdefault((buffer.dtype, buffer.numel()), []).append(buffer)
                self._idle_bytes += buffer.nbytes
