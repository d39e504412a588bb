"""A joiner's download of a donor's state, with a real donor process reached through a slow proxy: a stop request
cancels it at once (nothing trained, nothing written), and one download has a deadline over all its donors."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from .swarm_harness import Bootstrap, NodeProcess, stop_all
from .throttling_proxy import ThrottlingProxy, free_port

TRAIN = ["--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "2", "--inner-steps", "10"]
RATE = 25_000  # bytes/s: the tiny model's 2 MB fp32 state takes about 80 s through the donor's proxy


def _wait(condition: object, timeout: float, what: str, nodes: list[NodeProcess]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}:\n" + "\n".join(n.output()[-1500:] for n in nodes)
        time.sleep(0.2)


def test_a_stop_cancels_a_joiners_download_and_a_download_gives_up_within_its_deadline(
    bootstrap: Bootstrap, tmp_path: Path
) -> None:
    port = free_port()
    proxy = ThrottlingProxy(port, bytes_per_second=RATE)
    common = [*TRAIN, "--steps", "100000", "--num-shards", "3"]
    donor = NodeProcess(
        "donor", bootstrap, tmp_path, *common, "--shard-index", "0", "--grpc-port", str(port),
        "--announce-port", str(proxy.port),
    )  # fmt: skip
    nodes = [donor]
    try:
        _wait(lambda: (s := donor.status()) and s["outer_step"] >= 2, 120, "the donor did not train", nodes)
        stopped = NodeProcess("stopped", bootstrap, tmp_path, *common, "--shard-index", "1")
        # One donor's deadline is 10 s here (--exchange-timeout 5 and a link rate that moves 2 MB at once): the
        # download's, over all its attempts, is twice that, though 3 rounds of 10 s were left to try.
        impatient = NodeProcess(
            "impatient", bootstrap, tmp_path, *common, "--shard-index", "2", "--exchange-timeout", "5",
            "--min-link-rate", "1e9",
        )  # fmt: skip
        nodes += [stopped, impatient]
        _wait(lambda: proxy.relayed > 200_000, 90, "no state flowed to the joiners", nodes)
        asked = time.monotonic()
        stopped.process.send_signal(signal.SIGTERM)
        assert stopped.wait(timeout=30) == 0, stopped.output()[-3000:]
        left_after = time.monotonic() - asked
        assert "nothing was trained or written" in stopped.output(), stopped.output()[-3000:]
        assert not (stopped.data_dir / "checkpoint.pt").exists()  # a restart downloads again, not from a seed
        assert left_after < 15, left_after  # not the ~70 s the rest of the download would take
        _wait(lambda: "starting run" in impatient.output(), 90, "the impatient joiner never started", nodes)
        output = impatient.output()
        assert "gave up downloading a state after 20 s" in output, output[-3000:]
        assert "joined a run in progress" not in output
    finally:
        stop_all(nodes)
        proxy.close()
