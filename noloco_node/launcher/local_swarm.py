"""The one local-swarm launcher: a bootstrap peer and N `noloco-node join` processes on 127.0.0.1.

Nodes are real processes with their own DHT peer, gRPC server and status endpoint; each can be stopped
gracefully, killed, restarted on its data directory, or replaced by a newcomer with an empty one. The user's
``noloco-node swarm`` (launcher/swarm.py), the benchmarks (bench idle, chaos, straggler, stragglers) and the test
harness all start nodes through :func:`launch_node` and :class:`LocalSwarm`, and stop them through
:func:`stop_gracefully`. Given a shaped network (noloco_bench/shaped_network.py, for `bench race`), each node runs
in its own network namespace behind an emulated internet link, and the bootstrap peer in the router's namespace.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from noloco_node.node.bootstrap import start_bootstrap_process
from noloco_node.observability.status_file import read_status_document


class HostNetwork(Protocol):
    """Hosts in network namespaces behind emulated links (noloco_bench/shaped_network.py builds one): where each
    node and the bootstrap peer run and which addresses they use. The launcher only calls these."""

    @property
    def control_plane(self) -> bool: ...

    def address(self, host: int) -> str: ...

    def control_address(self, host: int) -> str: ...

    def exec_prefix(self, host: int) -> list[str]: ...

    def router_address(self, host: int) -> str: ...

    def router_exec_prefix(self) -> list[str]: ...

    @property
    def control_router_address(self) -> str: ...


def join_command(
    maddrs: Sequence[str], data_dir: Path, *args: str, log_format: str = "text", work: str = "join"
) -> list[str]:
    """The command line of one local swarm member: one torch thread (LocalSwarm gives nodes on a GPU more), its own
    data directory, an ephemeral status port (many nodes on one machine; each logs its URL and writes it into its
    status.json). ``work`` is the command: ``join`` (pretraining) or ``rl`` (RL post-training with shared
    rollouts)."""
    return [
        sys.executable,
        "-m",
        "noloco_node",
        "--log-format",
        log_format,
        work,
        "--bootstrap",
        *maddrs,
        "--data-dir",
        str(data_dir),
        "--torch-threads",
        "1",
        "--status-port",
        "0",
        *args,
    ]


# Sets the open-file limit, then becomes the node. Not ``preexec_fn``: Python code between fork and exec in a
# process with gRPC threads (a test runner, a benchmark) runs gRPC's fork handlers, which restart a poller in the
# child that close_fds then breaks ("Epoll1Poller ... epoll_wait error: Bad file descriptor", 13 of 200 forks here)
# and which once left a node hung before exec. Without it, subprocess forks with vfork and runs nothing.
_LIMIT_THEN_EXEC = (
    "import os, resource, sys; n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def host_threads_on_a_gpu(args: Sequence[str], num_nodes: int) -> int | None:
    """Torch threads for each of ``num_nodes`` nodes training on this machine's GPU: the host's cores, shared out.

    A node on a CPU keeps :func:`join_command`'s one thread (None here): the cores are the nodes' training, one
    each. A node on a GPU trains there, and its host threads run the outer step (the blend of fp32 weights
    on the host, 2.7 s at 1.3b on 16 cores of an H100 machine): one thread would make that several times slower."""
    device = "auto"
    for flag, value in itertools.pairwise(args):
        if flag == "--device":
            device = value
    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return max(1, (os.cpu_count() or 1) // max(1, num_nodes)) if on_gpu else None


def launch_node(
    maddrs: Sequence[str],
    data_dir: Path,
    args: Sequence[str],
    log_path: Path,
    *,
    env: dict[str, str] | None = None,
    log_format: str = "text",
    open_files: int | None = None,
    exec_prefix: Sequence[str] = (),
    work: str = "join",
) -> subprocess.Popen[bytes]:
    """Start one node process, its output in ``log_path``; ``open_files`` sets its open-file limit (soft and hard),
    for drills of a node on a host with a low one; ``exec_prefix`` runs it behind a command such as ``ip netns
    exec NS``."""
    command = join_command(maddrs, data_dir, *args, log_format=log_format, work=work)
    if open_files is not None:
        command = [sys.executable, "-c", _LIMIT_THEN_EXEC, str(open_files), *command]
    command = [*exec_prefix, *command]
    data_dir.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:  # the child holds its own descriptor
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


Process = subprocess.Popen[bytes] | subprocess.Popen[str]


def stop_gracefully(process: Process, timeout: float) -> int:
    """One SIGTERM, then SIGKILL if it has not left within ``timeout`` s; returns its exit code (-9 when killed).

    One: a node leaves gracefully on the first, and a second one sent while it is already tearing down could
    only cut that short."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    return wait_or_kill(process, timeout)


def stop_together(processes: Sequence[Process], timeout: float) -> list[int]:
    """Stop processes gracefully, all at once: one SIGTERM each, then each waited for (SIGKILL past ``timeout`` s);
    returns their exit codes. A graceful leave takes a node 1-2 s (its last checkpoint, its DHT record withdrawn),
    which one after another would add up."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    return [wait_or_kill(process, timeout) for process in processes]


def wait_or_kill(process: Process, timeout: float) -> int:
    """Its exit code once it has left, or -9 after a SIGKILL when it has not within ``timeout`` s."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return -9


@dataclass
class NodeSlot:
    """One place in the swarm; successive processes (lives) occupy it after kills and restarts."""

    index: int
    data_dir: Path
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the environment of each of its processes
    process: subprocess.Popen[bytes] | None = None
    lives: int = 0
    killed_by_us: bool = False
    outcomes: Counter[str] = field(default_factory=Counter)  # exchange outcomes summed over finished lives
    crashes: list[int] = field(default_factory=list)  # exit codes of lives that ended on their own, badly


class LocalSwarm:
    def __init__(
        self,
        base: Path,
        num_nodes: int,
        node_args: Sequence[str],
        per_node_args: Sequence[Sequence[str]] | None = None,
        *,
        network: HostNetwork | None = None,
        per_node_env: Sequence[Mapping[str, str]] | None = None,
    ) -> None:
        """``per_node_env``: variables added to each node's environment (a drill: node/fault_injection.py)."""
        self.base = base
        self.network = network
        base.mkdir(parents=True, exist_ok=True)
        if network is None:
            self.bootstrap, self.maddrs = start_bootstrap_process(base / "bootstrap.log")
        else:  # in the router's namespace: every host reaches it, and its introductions use no host's link
            host = network.control_router_address if network.control_plane else network.router_address(0)
            self.bootstrap, self.maddrs = start_bootstrap_process(
                base / "bootstrap.log", host=host, exec_prefix=network.router_exec_prefix()
            )
        extra = per_node_args or [[] for _ in range(num_nodes)]
        envs = per_node_env or [{} for _ in range(num_nodes)]
        self.slots = []
        for i in range(num_nodes):
            args = ["--shard-index", str(i), "--num-shards", str(num_nodes), *self._network_args(i)]
            threads = host_threads_on_a_gpu([*node_args, *extra[i]], num_nodes)
            args += ["--torch-threads", str(threads)] if threads else []
            self.slots.append(NodeSlot(i, base / f"node{i}", [*args, *node_args, *extra[i]], dict(envs[i])))
        for slot in self.slots:
            self.start(slot)

    def _network_args(self, index: int) -> list[str]:
        """On a shaped network, node ``index`` serves gRPC on its host's address, and the DHT there too or on its
        control-plane address."""
        if self.network is None:
            return []
        net = self.network
        dht = net.control_address(index) if net.control_plane else net.address(index)
        return ["--grpc-host", net.address(index), "--dht-host-maddrs", f"/ip4/{dht}/tcp/0"]

    def start(self, slot: NodeSlot) -> None:
        slot.lives += 1
        slot.killed_by_us = False
        slot.process = launch_node(
            self.maddrs,
            slot.data_dir,
            slot.args,
            self.base / f"node{slot.index}.life{slot.lives}.log",
            env=slot.env,
            exec_prefix=self.network.exec_prefix(slot.index) if self.network is not None else (),
        )

    def status(self, slot: NodeSlot) -> dict[str, Any] | None:
        return read_status_document(slot.data_dir)

    def _bank(self, slot: NodeSlot) -> None:
        """Add a finished life's exchange counters (its last status.json) to the slot's totals."""
        status = self.status(slot)
        if status:
            slot.outcomes.update(status.get("exchange_outcomes", {}))

    def kill(self, slot: NodeSlot) -> None:
        assert slot.process is not None
        slot.killed_by_us = True
        slot.process.send_signal(signal.SIGKILL)
        slot.process.wait()
        self._bank(slot)

    def replace(self, slot: NodeSlot) -> None:
        """A newcomer takes the place of a node that is gone for good: an empty data directory."""
        shutil.rmtree(slot.data_dir, ignore_errors=True)
        self.start(slot)

    def poll(self) -> None:
        """Record lives that ended on their own: exit 0 is a finished run, anything else a crash."""
        for slot in self.slots:
            if slot.process is not None and slot.process.poll() is not None and not slot.killed_by_us:
                if slot.process.returncode != 0:
                    slot.crashes.append(slot.process.returncode)
                self._bank(slot)
                slot.killed_by_us = True  # banked; do not count this life again

    def running(self) -> list[NodeSlot]:
        return [slot for slot in self.slots if slot.process is not None and slot.process.poll() is None]

    def stop(self, timeout: float = 60.0) -> list[int]:
        """Stop every node gracefully (one SIGTERM each, all at once), then the bootstrap peer; returns the nodes'
        exit codes."""
        started = [slot for slot in self.slots if slot.process is not None]
        codes = stop_together([slot.process for slot in started if slot.process is not None], timeout)
        for slot, code in zip(started, codes, strict=True):
            if code == -9 and not slot.killed_by_us:
                slot.crashes.append(-9)  # did not leave within the bound: counted as a failure
        self.poll()
        stop_gracefully(self.bootstrap, 20)
        return codes

    def logs(self, slot: NodeSlot) -> str:
        return "".join(
            (self.base / f"node{slot.index}.life{life}.log").read_text(errors="replace")
            for life in range(1, slot.lives + 1)
        )


def steps_per_second(history: list[dict[str, Any]]) -> float:
    """A node's inner steps trained per second between its first and last outer step (start-up excluded): the
    phases' own step counts, since a catch-up moves the step counter without training."""
    if len(history) < 2:
        return 0.0
    trained = sum(
        later.get("phase_steps") or later["inner_step"] - earlier["inner_step"]
        for earlier, later in itertools.pairwise(history)
    )
    return trained / (history[-1]["time"] - history[0]["time"])
