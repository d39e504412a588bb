"""Real processes for swarm tests: a `noloco-node bootstrap` peer and `noloco-node join` nodes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from noloco_node.discovery.bootstrap import start_bootstrap_process
from noloco_node.launcher.swarm import join_command


class Bootstrap:
    def __init__(self, log_dir: Path) -> None:
        self.process, self.maddrs = start_bootstrap_process(log_dir / "bootstrap.log")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()


class NodeProcess:
    def __init__(
        self,
        name: str,
        bootstrap: Bootstrap,
        base: Path,
        *args: str,
        log_format: str = "text",
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.data_dir = base / name
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = base / f"{name}.log"
        self.log = self.log_path.open("w")
        self.command = join_command(bootstrap.maddrs, self.data_dir, *args)
        join_at = self.command.index("join")
        self.command[join_at:join_at] = ["--log-format", log_format]  # a global flag: before the subcommand
        self.process = subprocess.Popen(
            self.command, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
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
        try:
            return json.loads((self.data_dir / "status.json").read_text())
        except (OSError, ValueError):
            return None

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        finally:
            self.log.flush()

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()
