"""The node's process: ``noloco-node join`` builds a :class:`~noloco_node.node.daemon.Node` and runs it on uvloop.

Before the node exists, bootstrap URLs are expanded to the multiaddresses they list; the DHT is started while the
process still has one thread (it forks a helper). A rank of a multi-GPU member (torchrun) other than rank 0 runs
no node at all: it follows rank 0 (training/follower.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn

from noloco_node import algorithm
from noloco_node.config.models import DataConfig, OuterConfig, TrainConfig
from noloco_node.config.node_config import NodeConfig
from noloco_node.node.bootstrap import expand_bootstrap
from noloco_node.node.catch_up import NodeError
from noloco_node.node.daemon import Node
from noloco_node.training.data_parallel import DataParallel, DataParallelError
from noloco_node.training.follower import run_follower

log = logging.getLogger("noloco_node.node.daemon")  # the node's own lines, whichever module says them

# Once the node's stack has unwound (state checkpointed, record withdrawn, servers stopped), the threads it started
# have this long to end. Python's exit joins every executor thread without a limit, and one finished node never
# exited: its exchange thread stayed blocked in gRPC's response iterator past the call's deadline.
EXIT_GRACE_SECONDS = 10.0


def leave_process(code: int) -> NoReturn:
    """Leaves with ``code`` once every other non-daemon thread has ended, or EXIT_GRACE_SECONDS have passed (a thread
    still running then is logged with its stack). The interpreter's finalization is skipped (``os._exit``, after the
    logs and standard streams are flushed): nothing is left to save by then, and finalizing gRPC's C core while its
    polling threads still wake for the GIL is a known way for a process to die of SIGSEGV on its way out
    (grpc/grpc#18456), which an orchestrator would read as a crash and restart."""
    deadline = time.monotonic() + EXIT_GRACE_SECONDS
    others = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    for thread in others:
        thread.join(max(0.0, deadline - time.monotonic()))
    frames = sys._current_frames()
    for thread in (t for t in others if t.is_alive()):
        stack = "".join(traceback.format_stack(frames[thread.ident])) if thread.ident in frames else "(no stack)\n"
        log.warning("thread %s still running %.0f s after the node stopped; leaving without it:\n%s",
                    thread.name, EXIT_GRACE_SECONDS, stack)  # fmt: skip
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_node(node_cfg: NodeConfig, train_cfg: TrainConfig, outer_cfg: OuterConfig, data_cfg: DataConfig) -> int:
    """Build the node and run it on uvloop (plain asyncio where uvloop is unavailable); a rank of a multi-process
    member (torchrun) runs its part and leaves the process itself (DataParallel.exit_process says why)."""
    algorithm.warn_on_unstable_hyperparameters(outer_cfg.alpha, outer_cfg.beta, outer_cfg.effective_gamma)
    data_parallel = DataParallel.from_environment()
    if data_parallel is None:
        return _run_node(node_cfg, train_cfg, outer_cfg, data_cfg, None)
    try:
        train_cfg = train_cfg.model_copy(update={"device": data_parallel.device(train_cfg.device)})
        if data_parallel.leader:
            code = _run_node(node_cfg, train_cfg, outer_cfg, data_cfg, data_parallel)
        else:  # another GPU of this member: no DHT, no gRPC, it follows rank 0
            code = run_follower(node_cfg, train_cfg, data_cfg, data_parallel)
    except (NodeError, DataParallelError) as error:
        log.error("rank %d of the member: %s", data_parallel.rank, error)
        code = 2
    except BaseException:
        log.exception("rank %d of the member failed", data_parallel.rank)
        code = 1
    data_parallel.exit_process(code)


def _run_node(
    node_cfg: NodeConfig,
    train_cfg: TrainConfig,
    outer_cfg: OuterConfig,
    data_cfg: DataConfig,
    data_parallel: DataParallel | None,
) -> int:
    node_cfg = with_bootstrap_expanded(node_cfg)
    node = Node(node_cfg, train_cfg, outer_cfg, data_cfg)
    # The DHT forks a helper process: start it while this process has a single thread (the start order above).
    node.discovery.start()
    if data_parallel is not None:
        data_parallel.start()
        node.trainer.data_parallel = data_parallel
    code = run_on_uvloop(node.run)
    if data_parallel is None:
        leave_process(code)
    return code


def with_bootstrap_expanded(node_cfg: NodeConfig) -> NodeConfig:
    """The settings with bootstrap URLs replaced by the multiaddresses they list (NodeError if none answers)."""
    if not any(entry.startswith(("http://", "https://")) for entry in node_cfg.bootstrap):
        return node_cfg
    try:
        maddrs = expand_bootstrap(node_cfg.bootstrap, wait=node_cfg.bootstrap_wait)
    except OSError as error:
        raise NodeError(str(error)) from None
    return node_cfg.model_copy(update={"bootstrap": maddrs})


def run_on_uvloop(run: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """A daemon's ``run`` on uvloop (plain asyncio where uvloop is unavailable); its exit code."""
    try:
        import uvloop
    except ImportError:
        code = asyncio.run(run())
    else:
        code = uvloop.run(run())
    # The loop has finished (and with it the node's handlers): a stop signal sent again now, by a launcher or an
    # orchestrator that repeats itself, would kill a node that is already leaving cleanly.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    return code
