"""`noloco-node doctor` against each failure it names (issue 29): the real command in a subprocess, a real
bootstrap peer and DHT where the check needs one. Each failure's message and fix are asserted, and the exit code."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from noloco_node.discovery.dht import PeerRecord
from noloco_node.node.bootstrap import start_bootstrap_process
from noloco_node.node.doctor import clock

from .swarm_harness import Bootstrap, NodeProcess
from .throttling_proxy import free_port


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
        # On the CPU: a GPU machine's host holds less of the model (it trains in device memory), so 60 B/param is the
        # CPU's estimate.
        code, checks = doctor(tmp_path, "--grpc-port", str(port), "--model", "6.8b", "--device", "cpu")
    assert code == 1
    assert checks["gRPC port"]["level"] == "fail" and f"127.0.0.1:{port}" in checks["gRPC port"]["detail"]
    assert "another --grpc-port" in checks["gRPC port"]["fix"]
    memory = checks["host memory"]
    assert memory["level"] == "fail" and "x 60 B/param" in memory["detail"] and "GiB available" in memory["detail"]
    assert "smaller --model" in memory["fix"]
    assert checks["bootstrap"]["level"] == "warn"  # no --bootstrap: a swarm of its own, not a failure
    assert checks["identity"]["level"] == "warn" and "new peer id" in checks["identity"]["detail"]  # a fresh dir


def test_on_a_card_of_given_memory_the_plan_names_what_fits_and_refuses_what_does_not(tmp_path: Path) -> None:
    """--gpu-memory plans for a card this machine does not have: the memory model, before anything is loaded."""
    shape = ("--seq-len", "1024", "--batch-size", "256")
    (tmp_path / "fits").mkdir()
    (tmp_path / "refused").mkdir()
    with ThreadPoolExecutor(2) as pool:  # two independent plans, at once
        fitting = pool.submit(doctor, tmp_path / "fits", "--model", "125m", *shape, "--gpu-memory", "24")
        too_large = pool.submit(doctor, tmp_path / "refused", "--model", "6.8b", *shape, "--gpu-memory", "80")
        (_, checks), (refused_code, refused_checks) = fitting.result(), too_large.result()
    plan, fits = checks["step plan"], checks["what fits"]
    assert plan["level"] == "ok" and "micro-batch 16 x 1024 tokens, 16 accumulated" in plan["detail"]
    assert "of 24.0 GiB" in plan["detail"]
    assert "125m micro-batch 16" in fits["detail"] and "1.3b does not fit" in fits["detail"]
    # 6.8b on one H100 (80 GiB): refused with the numbers.
    refused = refused_checks["step plan"]
    assert refused_code == 1 and refused["level"] == "fail"
    assert "does not fit: 128.0 GiB for weights, gradients and Adam (8.59B parameters x 16 B)" in refused["detail"]
    assert "over 85% of 80.0 GiB" in refused["detail"] and "smaller --model" in refused["fix"]
    assert "1.3b micro-batch 8" in refused_checks["what fits"]["detail"]
    # ... and where it would fit: sharded over two such GPUs, one member (training/data_parallel.py).
    assert "shard it over 2 such GPUs (torchrun --nproc-per-node 2)" in refused["fix"]
    assert "6.8b does not fit (sharded over 2 such GPUs: micro-batch 2)" in refused_checks["what fits"]["detail"]


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
    assert checks["identity"]["level"] == "warn"  # a fresh data directory: no node key yet
    assert all(c["level"] == "ok" for name, c in checks.items() if name not in ("run", "reachable", "identity")), checks


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


def test_a_peer_dials_the_ports_back_and_a_closed_or_misdirected_forward_fails(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    """A live node of the run is the witness: it opens a connection back to the ports doctor names (rpc/
    info_serving.py). ``--announce-port`` plays the port forward: to the gRPC port itself (open), to a port nobody
    listens on (a forward never set up), and to a port another process holds (a forward to the wrong machine)."""
    run = ["--model", "tiny", "--seq-len", "64", "--steps", "100000", "--inner-steps", "50", *bootstrap.run_args()]
    witness = NodeProcess("witness", bootstrap, tmp_path, *run)
    try:
        for _ in range(120):  # its record is in the DHT once it has written its first status
            if (witness.status() or {}).get("outer_step") is not None:
                break
            time.sleep(1)
        closed = free_port()  # nothing listens there: a forward never set up

        def run_doctor(name: str, *extra: str) -> tuple[int, dict[str, dict[str, Any]], int, int]:
            grpc_port, dht_port = free_port(), free_port()
            ports = ["--grpc-port", str(grpc_port), "--dht-host-maddrs", f"/ip4/127.0.0.1/tcp/{dht_port}"]
            (tmp_path / name).mkdir()
            code, checks = doctor(tmp_path / name, "--bootstrap", *bootstrap.maddrs, *run, *ports, *extra)
            return code, checks, grpc_port, dht_port

        # The three runs are independent (ports and data dirs of their own): at once, the witness answers each.
        with socket.socket() as elsewhere, ThreadPoolExecutor(3) as pool:
            elsewhere.bind(("127.0.0.1", 0))  # another process answers at this port: a forward to the wrong machine
            elsewhere.listen()
            other = elsewhere.getsockname()[1]
            runs = [
                pool.submit(run_doctor, "open"),
                pool.submit(run_doctor, "closed", "--announce-port", str(closed)),
                pool.submit(run_doctor, "wrong", "--announce-port", str(other)),
            ]
            (code, checks, grpc_port, dht_port), closed_run, wrong_run = (run.result() for run in runs)
        assert checks["run"]["level"] == "ok", checks["run"]
        assert checks["reachable"]["level"] == "ok"
        opened = checks["gRPC port from outside"]
        assert opened["level"] == "ok" and f"opened a connection to 127.0.0.1:{grpc_port}" in opened["detail"]
        dht = checks["DHT port from outside"]
        assert dht["level"] == "ok" and f"127.0.0.1:{dht_port}" in dht["detail"], dht
        assert code == 0, checks

        code, checks, grpc_port, _ = closed_run
        failed = checks["gRPC port from outside"]
        assert code == 1 and failed["level"] == "fail"
        assert f"could not open a connection to 127.0.0.1:{closed} (Connection refused)" in failed["detail"]
        assert f"open TCP {closed} in the firewall" in failed["fix"]
        assert f"forward it to this machine's port {grpc_port}" in failed["fix"]

        code, checks, grpc_port, _ = wrong_run
        wrong = checks["gRPC port from outside"]
        assert code == 1 and wrong["level"] == "fail", wrong
        assert "but not to this machine: something else answers there" in wrong["detail"]
        assert f"forward TCP {other} to this machine's port {grpc_port}, not to another one" in wrong["fix"]
    finally:
        witness.stop()
