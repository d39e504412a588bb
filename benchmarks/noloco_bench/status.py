"""`noloco-node bench status`: what serving the status endpoint costs a training node.

One real node process (bootstrap peer, DHT, gRPC, trainer thread, status endpoint: `noloco-node join`) trains
alone. The bench alternates quiet phases and phases in which a client polls `GET /status` at a fixed rate (10 per
second by default), each ``window`` seconds long, and measures the trainer's progress in each from the node's own
inner-step counter (read once at each phase boundary). Alternating cancels slow drifts of a shared machine; the
figure is the ratio of polled to quiet throughput, with the poll latency next to it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from noloco_node.launcher.local_swarm import join_command
from noloco_node.node.bootstrap import start_bootstrap_process
from noloco_node.observability.status_file import read_status_document


@dataclass
class StatusBenchResult:
    quiet_steps_per_second: list[float] = field(default_factory=list)
    polled_steps_per_second: list[float] = field(default_factory=list)
    poll_latencies: list[float] = field(default_factory=list)
    polls: int = 0
    poll_hz: float = 10.0
    window: float = 20.0

    def ratio(self) -> float:
        return statistics.median(
            polled / quiet
            for polled, quiet in zip(self.polled_steps_per_second, self.quiet_steps_per_second, strict=True)
        )

    def report(self) -> str:
        quiet = statistics.mean(self.quiet_steps_per_second)
        spread = max(self.quiet_steps_per_second) - min(self.quiet_steps_per_second)
        latencies = sorted(self.poll_latencies)
        p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
        return "\n".join(
            [
                f"phases of {self.window:.0f} s, alternating; {len(self.quiet_steps_per_second)} of each",
                "quiet:   " + ", ".join(f"{v:.1f}" for v in self.quiet_steps_per_second) + " inner steps/s",
                "polled:  " + ", ".join(f"{v:.1f}" for v in self.polled_steps_per_second) + " inner steps/s",
                f"polling: {self.polls} GET /status at {self.poll_hz:.0f}/s, latency p50 {p50 * 1e3:.1f} ms, "
                f"p99 {p99 * 1e3:.1f} ms",
                f"throughput polled / quiet: {self.ratio():.3f} (median over rounds of each polled phase against "
                f"the quiet one before it; quiet phases themselves vary by {spread / quiet:.1%})",
            ]
        )


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read()


def _inner_step(url: str) -> int:
    return json.loads(_get(url + "/status"))["inner_step"]


def _poll(url: str, hz: float, stop: threading.Event, result: StatusBenchResult) -> None:
    period = 1.0 / hz
    next_at = time.monotonic()
    while not stop.is_set():
        started = time.monotonic()
        _get(url + "/status")
        result.poll_latencies.append(time.monotonic() - started)
        result.polls += 1
        next_at += period
        stop.wait(max(0.0, next_at - time.monotonic()))


def _measure(url: str, window: float) -> float:
    before, started = _inner_step(url), time.monotonic()
    time.sleep(window)
    return (_inner_step(url) - before) / (time.monotonic() - started)


def run_status_bench(model: str, *, window: float, rounds: int, poll_hz: float) -> StatusBenchResult:
    result = StatusBenchResult(poll_hz=poll_hz, window=window)
    with tempfile.TemporaryDirectory(prefix="noloco-bench-status-") as tmp:
        base = Path(tmp)
        bootstrap, maddrs = start_bootstrap_process(base / "bootstrap.log")
        log = (base / "node.log").open("w")
        # Long phases and no waiting for partners: the trainer runs flat out, so any cost of serving shows.
        node = subprocess.Popen(
            join_command(
                maddrs,
                base / "node",
                "--model",
                model,
                "--steps",
                "10000000",
                "--inner-steps",
                "200",
                "--eval-batches",
                "2",
                "--alone-grace",
                "0",
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            url = _wait_for_training(base / "node", node)
            time.sleep(min(5.0, window))  # past start-up transients
            for _ in range(rounds):
                result.quiet_steps_per_second.append(_measure(url, window))
                stop = threading.Event()
                poller = threading.Thread(target=_poll, args=(url, poll_hz, stop, result), daemon=True)
                poller.start()
                result.polled_steps_per_second.append(_measure(url, window))
                stop.set()
                poller.join()
        finally:
            for process in (node, bootstrap):
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
            log.close()
    return result


def _wait_for_training(data_dir: Path, node: subprocess.Popen[bytes], timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.poll() is not None:
            raise RuntimeError(f"the node exited with {node.returncode} before training")
        url = (read_status_document(data_dir) or {}).get("status_url")
        try:
            if url and _inner_step(url) > 0:
                return url
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the node did not start training within {timeout:.0f} s")
