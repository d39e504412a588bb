"""Background tasks of the node's event loop, supervised: none of them may die silently.

Each task (refreshing the DHT record, watching peers for the status page, overlap-mode exchanges) runs under
:meth:`Supervisor.spawn`. A task that raises is logged with its traceback and restarted after a backoff that
doubles with each consecutive failure (1 s up to a minute); one that ran for ``healthy_after`` seconds before it
failed starts counting afresh. Restarts are visible: ``/status`` lists every task with its restarts and last
error, ``/metrics`` counts them. A task that fails ``give_up_after`` times in a row is not restarted again and
turns the node's health to failed, so ``/healthz`` answers 503 and an orchestrator restarts the whole node: a
node that no longer pairs or publishes must not look healthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class TaskState:
    """What ``/status`` shows of one supervised task."""

    name: str
    restarts: int = 0
    consecutive_failures: int = 0
    last_error: str | None = None
    gave_up: bool = False
    finished: bool = False


class Supervisor:
    def __init__(
        self,
        *,
        initial_backoff: float = 1.0,
        max_backoff: float = 60.0,
        give_up_after: int = 5,
        healthy_after: float = 60.0,
    ) -> None:
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self.give_up_after = give_up_after
        self.healthy_after = healthy_after
        self.tasks: dict[str, TaskState] = {}
        self._running: dict[str, asyncio.Task[None]] = {}

    def spawn(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        """Run ``run()`` on the event loop under supervision; a return ends the task, an exception restarts it."""
        if name in self._running:
            raise ValueError(f"a task named {name} is already supervised")
        self.tasks[name] = TaskState(name)
        self._running[name] = asyncio.create_task(self._supervise(self.tasks[name], run), name=name)

    async def _supervise(self, state: TaskState, run: Callable[[], Awaitable[None]]) -> None:
        while True:
            started = time.monotonic()
            try:
                await run()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                if time.monotonic() - started >= self.healthy_after:
                    state.consecutive_failures = 0
                state.consecutive_failures += 1
                state.last_error = f"{type(error).__name__}: {error}"
                if state.consecutive_failures >= self.give_up_after:
                    state.gave_up = True
                    log.exception("background task %s failed %d times in a row; not restarting it", state.name,
                                  state.consecutive_failures)  # fmt: skip
                    return
                backoff = min(self.max_backoff, self.initial_backoff * 2 ** (state.consecutive_failures - 1))
                log.exception("background task %s failed; restarting it in %.0f s", state.name, backoff)
                await asyncio.sleep(backoff)
                state.restarts += 1
                continue
            state.finished = True
            return

    def problem(self) -> str | None:
        """Why the node is unwell because of its tasks (one gave up), or None."""
        failed = [state for state in self.tasks.values() if state.gave_up]
        if not failed:
            return None
        return "; ".join(
            f"background task {state.name} failed {state.consecutive_failures} times ({state.last_error})"
            for state in failed
        )

    async def stop(self, timeout: float = 5.0) -> None:
        """Cancel every task and wait for them (each must end within ``timeout``)."""
        for task in self._running.values():
            task.cancel()
        for name, task in self._running.items():
            with contextlib.suppress(asyncio.CancelledError):
                try:
                    await asyncio.wait_for(task, timeout)
                except asyncio.TimeoutError:
                    log.warning("background task %s did not stop within %.0f s", name, timeout)
        self._running.clear()
