"""Real processes for swarm tests: a `noloco-node bootstrap` peer and `noloco-node join` nodes on 127.0.0.1."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path


class Bootstrap:
    def __init__(self, log_dir: Path) -> None:
        self.log = (log_dir / "bootstrap.log").open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "noloco_node", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.maddrs: list[str] = []
        deadline = time.monotonic() + 60
        assert self.process.stdout is not None
        while time.monotonic() < deadline and not self.maddrs:
            line = self.process.stdout.readline()
            if not line:
                break
            if "--bootstrap" in line:
                self.maddrs.append(line.split("--bootstrap", 1)[1].strip())
        assert self.maddrs, "the bootstrap peer printed no multiaddr"

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


class NodeProcess:
    def __init__(self, name: str, bootstrap: Bootstrap, base: Path, *args: str) -> None:
        self.name = name
        self.data_dir = base / name
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = base / f"{name}.log"
        self.log = self.log_path.open("w")
        self.command = [
            sys.executable,
            "-m",
            "noloco_node",
            "join",
            "--bootstrap",
            *bootstrap.maddrs,
            "--data-dir",
            str(self.data_dir),
            "--torch-threads",
            "1",
            *args,
        ]
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)

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
