"""Slow tier: the CPU image builds from docker/Dockerfile.cpu (podman, a local debootstrapped base) and a 2-node
swarm runs from the built image's filesystem, as the image's user, with its environment and entrypoint."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from .image_runner import ImageRoot, build_cpu_image, ensure_base, missing_tools
from .throttling_proxy import free_port

pytestmark = pytest.mark.slow
TAG = "localhost/noloco-node:cpu-test"


@pytest.mark.skipif(missing_tools() is not None, reason=str(missing_tools()))
def test_the_cpu_image_builds_and_runs_a_swarm(tmp_path: Path) -> None:
    log = tmp_path / "build.log"
    ensure_base(log)
    inspected = build_cpu_image(TAG, log)
    config = inspected["Config"]
    assert config["User"] == "noloco" and config["Entrypoint"] == ["noloco-node"] and config["StopSignal"] == "SIGTERM"
    assert "/healthz" in " ".join(inspected["Healthcheck"]["Test"])
    assert set(config["ExposedPorts"]) == {"7000/tcp", "31338/tcp", "8470/tcp"} and "/data" in config["Volumes"]
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o777)  # the image's user (uid 10001) writes here
    image = ImageRoot(TAG, config, data, tmp_path / "scratch")
    processes = []
    try:
        book = free_port()
        bootstrap = image.popen(
            [
                "bootstrap",
                "--host-maddrs",
                "/ip4/127.0.0.1/tcp/0",
                "--http-port",
                str(book),
                "--http-host",
                "127.0.0.1",
            ],
            tmp_path / "bootstrap.log",
        )
        processes.append(bootstrap)
        common = [
            *("--bootstrap", f"http://127.0.0.1:{book}/maddrs", "--grpc-port", "0", "--status-port", "0"),
            *("--dht-host-maddrs", "/ip4/127.0.0.1/tcp/0", "--torch-threads", "1", "--max-bytes", "2000000"),
            *("--model", "tiny", "--seq-len", "64", "--steps", "160", "--inner-steps", "20", "--pair-timeout", "5"),
        ]
        nodes = [
            image.popen(
                ["join", *common, "--data-dir", f"/data/node{i}", "--shard-index", str(i)], tmp_path / f"node{i}.log"
            )
            for i in range(2)
        ]
        processes += nodes
        codes = [node.wait(timeout=600) for node in nodes]
        logs = "\n".join((tmp_path / f"node{i}.log").read_text()[-2000:] for i in range(2))
        assert codes == [0, 0], logs
        statuses = [json.loads((data / f"node{i}" / "status.json").read_text()) for i in range(2)]
        ids = {s["peer_id"] for s in statuses}
        for status in statuses:
            assert status["health"]["state"] == "finished" and status["reachable"]
            partners = {h["partner"] for h in status["history"] if h["partner"]}
            assert partners == ids - {status["peer_id"]}, partners  # they found each other and blended
        key = data / "node0" / "node_key.pem"
        assert key.stat().st_uid == 10001 and key.stat().st_mode & 0o777 == 0o600  # written by the image's user
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=30)
                except Exception:
                    process.kill()
        time.sleep(0.5)
        image.close()
