"""Real processes for swarm tests: a `noloco-node bootstrap` peer and `noloco-node join` nodes on 127.0.0.1, started
and stopped by the package's one launcher (noloco_node/launcher/local_swarm.py); this adds what tests look at."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from noloco_node.launcher.local_swarm import launch_node, stop_gracefully, stop_together
from noloco_node.node.bootstrap import start_bootstrap_process
from noloco_node.observability.status_file import read_status_document


class Bootstrap:
    """A `noloco-node bootstrap` process. ``run_name`` is the run its test's nodes join (NodeProcess passes it as
    --run-name unless a test names its own); None leaves the nodes' default."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.run_name: str | None = None
        self.process, self.maddrs = start_bootstrap_process(log_dir / "bootstrap.log")

    def for_run(self, run_name: str) -> Bootstrap:
        """The same process, for nodes of the run ``run_name``."""
        view = copy.copy(self)
        view.run_name = run_name
        return view

    def run_args(self) -> list[str]:
        """What a node of this test adds to its command line to join its run."""
        return ["--run-name", self.run_name] if self.run_name else []

    def restart(self) -> None:
        """A new process after this one died (its log is kept beside the new one's)."""
        self.log_dir = self.log_dir / "restarted"
        self.log_dir.mkdir()
        self.process, self.maddrs = start_bootstrap_process(self.log_dir / "bootstrap.log")

    def stop(self) -> None:
        stop_gracefully(self.process, 20)


class NodeProcess:
    def __init__(
        self,
        name: str,
        bootstrap: Bootstrap,
        base: Path,
        *args: str,
        log_format: str = "text",
        env: dict[str, str] | None = None,
        open_files: int | None = None,
        work: str = "join",
    ) -> None:
        self.name = name
        self.data_dir = base / name
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # A node restarted under the same name logs to a file of its own: an earlier life's log is kept.
        self.log_path = base / f"{name}.log"
        lives = 1
        while self.log_path.exists():
            lives += 1
            self.log_path = base / f"{name}.life{lives}.log"
        if "--run-name" not in args:
            args = (*args, *bootstrap.run_args())
        self.process = launch_node(
            bootstrap.maddrs,
            self.data_dir,
            args,
            self.log_path,
            env=env,
            log_format=log_format,
            open_files=open_files,
            work=work,
        )

    def descendants(self) -> list[int]:
        """Every process below this node (its DHT helper and the p2pd daemon it runs), from /proc."""
        children: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        found, frontier = [], [self.process.pid]
        while frontier:
            below = children.get(frontier.pop(), [])
            found += below
            frontier += below
        return found

    def status(self) -> dict | None:
        return read_status_document(self.data_dir)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)

    def output(self) -> str:
        return self.log_path.read_text()

    def blend_report(self) -> str:
        """Why this node blended as it did, for a failing assertion: each outer step's partner or the loss check's
        verdict, its exchanges' outcomes, and its log's tail."""
        status = self.status() or {}
        steps = [
            f"{h['outer_step']}: "
            + (
                f"{h['partner'][-8:]}@{h['partner_step']}"
                if h["partner"]
                else "refused by the loss check"
                if h.get("loss_with_partner") is not None
                else "no partner"
            )
            for h in status.get("history", [])
        ]
        return (
            f"{self.name}: {'; '.join(steps)}\nexchanges: {status.get('exchange_outcomes')}\n" + self.output()[-3000:]
        )

    def stop(self) -> None:
        stop_gracefully(self.process, 30)


def stop_all(nodes: Iterable[NodeProcess]) -> list[int]:
    """Stop a test's nodes gracefully, all at once; returns their exit codes (-9: killed, not gracefully)."""
    return stop_together([node.process for node in nodes], 30)


def run_attacker(
    module: str, nodes: list[NodeProcess], seconds: float, *args: str, preparation: float = 0.0
) -> tuple[float, dict]:
    """Run ``python -m module`` (an attacking process of noloco_node/bench) against ``nodes`` for ``seconds``,
    after at most ``preparation`` seconds of its own (reading the weights it will use); returns when it started
    (Unix time) and the JSON report it printed last. The deadline adds 120 s for starting (torch and hivemind
    imports, the DHT, at nice 19 on a loaded machine) and stopping."""
    started = time.time()
    attacker = subprocess.run(
        [
            sys.executable,
            "-m",
            module,
            *(item for n in nodes for item in ("--data-dir", str(n.data_dir))),
            *("--seconds", str(seconds), *args),
        ],
        capture_output=True,
        text=True,
        timeout=preparation + seconds + 120,
    )
    assert attacker.returncode == 0, attacker.stderr[-3000:]
    return started, json.loads(attacker.stdout.strip().splitlines()[-1])


def wait_for_steps_after(nodes: list[NodeProcess], moment: float, timeout: float = 60.0) -> None:
    """Wait until each of ``nodes`` has ended two outer steps after ``moment`` (Unix time): the step it was in at
    that moment (one an attacker held, say) has ended, and one more."""
    deadline = time.monotonic() + timeout
    while True:
        ended = [sum(1 for h in (n.status() or {}).get("history", []) if h["time"] > moment) for n in nodes]
        if all(count >= 2 for count in ended):
            return
        assert time.monotonic() < deadline, f"outer steps ended after {moment:.1f}: {ended}"
        time.sleep(0.2)
