"""`noloco-node doctor` against each failure it names (issue 29): the real command in a subprocess, a real
bootstrap peer and DHT where the check needs one. Each failure's message and fix are asserted, and the exit code."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from noloco_node.discovery.dht import PeerRecord
from noloco_node.node.bootstrap import start_bootstrap_process
from noloco_node.node.doctor import clock


def doctor(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, dict[str, Any]]]:
    done = subprocess.run(
        [sys.executable, "-m", "noloco_node", "doctor", "--json", "--data-dir", str(tmp_path / "data"), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
    )
    assert done.stdout.strip().startswith("["), done.stderr[-2000:]
    return done.returncode, {c["name"]: c for c in json.loads(done.stdout)}


def test_a_dead_bootstrap_is_named_with_its_port_and_the_command_that_prints_a_good_one(tmp_path: Path) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # closed again when the block ends: nobody listens there
    code, checks = doctor(
        tmp_path, "--bootstrap", f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWEraSVCeTpK8Qf4afy9vfKh66QUJBNe5UPrN2ibJd1D3P"
    )
    assert code == 1
    assert checks["bootstrap"]["level"] == "fail"
    assert f"127.0.0.1:{port} does not answer" in checks["bootstrap"]["detail"]
    assert "noloco-node bootstrap" in checks["bootstrap"]["fix"] and f"TCP {port}" in checks["bootstrap"]["fix"]
    assert "DHT" not in checks  # nothing further is tried through a bootstrap that is not there


def test_a_port_held_by_another_process_and_a_model_too_large_for_this_machine_fail(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code, checks = doctor(tmp_path, "--grpc-port", str(port), "--model", "6.8b")
    assert code == 1
    assert checks["gRPC port"]["level"] == "fail" and f"127.0.0.1:{port}" in checks["gRPC port"]["detail"]
    assert "another --grpc-port" in checks["gRPC port"]["fix"]
    memory = checks["host memory"]
    assert memory["level"] == "fail" and "x 60 B/param" in memory["detail"] and "GiB available" in memory["detail"]
    assert "smaller --model" in memory["fix"]
    assert checks["bootstrap"]["level"] == "warn"  # no --bootstrap: a swarm of its own, not a failure


def test_a_gpu_with_a_cpu_build_of_torch_is_a_failure(tmp_path: Path) -> None:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    tool = fake_bin / "nvidia-smi"  # what a machine with an NVIDIA driver has on its PATH
    tool.write_text("#!/bin/sh\necho 'NVIDIA-SMI 550.54'\n")
    tool.chmod(0o755)
    code, checks = doctor(tmp_path, env={"PATH": f"{fake_bin}:{os.environ['PATH']}"})
    torch_check = checks["torch"]
    if "CUDA" in torch_check["detail"].split("(")[1][:5]:
        pytest.skip("this torch is a CUDA build: the failure cannot be faked here")
    assert code == 1 and torch_check["level"] == "fail"
    assert "has an NVIDIA GPU but torch" in torch_check["detail"] and "CPU build" in torch_check["detail"]
    assert "CUDA build of torch" in torch_check["fix"]


def test_against_a_live_bootstrap_the_network_checks_pass_and_a_first_node_is_told_so(tmp_path: Path) -> None:
    bootstrap, maddrs = start_bootstrap_process(tmp_path / "bootstrap.log")
    try:
        code, checks = doctor(tmp_path, "--bootstrap", maddrs[0])
    finally:
        bootstrap.terminate()
        bootstrap.wait(timeout=30)
    assert code == 0, checks
    assert checks["bootstrap"]["level"] == "ok" and checks["DHT"]["level"] == "ok"
    assert checks["run"]["level"] == "warn" and "this node would be the first" in checks["run"]["detail"]
    assert all(c["level"] == "ok" for name, c in checks.items() if name not in ("run", "reachable")), checks


def test_a_skewed_clock_is_measured_against_the_peers_records() -> None:
    def record(updated: float) -> PeerRecord:
        return PeerRecord("p", "127.0.0.1:1", "f", updated=updated)

    now = 1_000_000.0
    records = [record(now - 4.0), record(now - 9.0)]  # refreshed every 10 s (record_ttl 30): fresh
    assert clock(records, now, record_ttl=30.0, tolerance=30.0).level == "ok"
    behind = clock(records, now - 120.0, record_ttl=30.0, tolerance=30.0)  # this clock 2 minutes slow
    assert behind.level == "fail" and "at least 116 s behind the peers'" in behind.detail and "set-ntp" in behind.fix
    ahead = clock(records, now + 120.0, record_ttl=30.0, tolerance=30.0)
    assert ahead.level == "fail" and "ahead of the peers'" in ahead.detail
