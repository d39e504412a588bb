"""The outsider's CPU group (noloco_bench/cpu_group.py): a process started through its prefix lands in a group
whose quota is the outsider's share, its children with it, and the group is gone afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from noloco_bench.cpu_group import CGROUP_ROOT, outsider_cpu


@pytest.mark.skipif(os.geteuid() != 0, reason="control groups need root")
def test_a_process_started_in_the_group_is_held_to_its_quota_with_its_children() -> None:
    name = f"noloco-test-{os.getpid()}"
    with outsider_cpu(0.25, name=name) as cpu:
        if not cpu.prefix:
            pytest.skip("no cpu controller on this machine")
        assert "0.25 core" in cpu.describe
        # The child's child reports its own control groups: inherited, as the attackers' p2pd daemons inherit.
        child = "import subprocess, sys; print(subprocess.check_output(['cat', '/proc/self/cgroup'], text=True))"
        done = subprocess.run([*cpu.prefix, sys.executable, "-c", child], capture_output=True, text=True, check=True)
        assert f"/{name}" in done.stdout, done.stdout
        v2 = (CGROUP_ROOT / "cgroup.controllers").exists()
        group = CGROUP_ROOT / name if v2 else CGROUP_ROOT / "cpu" / name
        quota = (group / "cpu.max").read_text().split()[0] if v2 else (group / "cpu.cfs_quota_us").read_text()
        assert int(quota) == 25_000  # a quarter of each 100 ms period
        stand_in = cpu.stand_in()
        assert stand_in is not None
        try:
            deadline = time.monotonic() + 10  # its shell writes its pid into the group, then becomes the loop
            while str(stand_in.pid) not in (group / "cgroup.procs").read_text().split():
                assert time.monotonic() < deadline and stand_in.poll() is None, "the stand-in never joined the group"
                time.sleep(0.05)
        finally:
            stand_in.kill()
            stand_in.wait()
    assert not Path(group).exists()
