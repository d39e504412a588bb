"""The outsider's own CPU on the swarm's cores: a control group with a hard quota, the same in both runs of a bench.

An attacker on the internet spends its own CPU; on the 2 cores a benchmark shares with the swarm it spends the
nodes'. ``nice 19`` does not keep it off them: it weighs each thread, and an outsider of a few dozen threads took a
third of the cores from three nodes (bench outsider, 2026-11-25: their inner steps 36% slower), so the bench
measured the emulation, not the defence. The lowest weight the kernel has (cpu.shares 2) starves it instead: it
never finished importing, and nothing was attacked.

So the outsider's host is a control group with a quota of ``cores`` (half a core by default): what the attacking
processes get however many threads they run. A stand-in busy loop in the same group (at the idle policy: it
yields to them) takes whatever part of the quota they leave, and runs in the run without the outsider too: in both
runs the nodes have the same CPU, the machine's less the quota, and the difference between them is what the
attacks cost the nodes.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


@dataclass(frozen=True)
class CpuGroup:
    """``prefix`` starts a command in the group (its children stay in it); ``()`` where none could be made."""

    prefix: tuple[str, ...]
    cores: float

    @property
    def describe(self) -> str:
        if not self.prefix:
            return "the attackers share the nodes' cores at nice 19 (no CPU group: needs root and a cpu controller)"
        return (
            f"the attackers' host: {self.cores:g} core (a CPU quota), filled by a stand-in busy loop in both runs, "
            f"so the nodes have the same CPU in both"
        )

    def stand_in(self) -> subprocess.Popen[bytes] | None:
        """The busy loop that fills the quota (None without a group)."""
        if not self.prefix:
            return None
        # SCHED_IDLE: inside the group it yields to every attacking thread, however low their nice
        loop = "import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\nwhile True: pass"
        return subprocess.Popen([*self.prefix, sys.executable, "-c", loop])


def _make(name: str, cores: float) -> Path | None:
    """The group's directory with its quota set: cgroup v2 (cpu.max) or v1 (cpu.cfs_quota_us); None if neither."""
    quota = str(int(cores * PERIOD_US))
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        if "cpu" not in (CGROUP_ROOT / "cgroup.subtree_control").read_text().split():
            return None
        group = CGROUP_ROOT / name
        group.mkdir(exist_ok=True)
        (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        return group
    if (CGROUP_ROOT / "cpu" / "cpu.cfs_quota_us").exists():
        group = CGROUP_ROOT / "cpu" / name
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(quota)
        return group
    return None


@contextlib.contextmanager
def outsider_cpu(cores: float = 0.5, name: str = "noloco-outsider") -> Iterator[CpuGroup]:
    """The group, removed on exit once its processes have ended."""
    group = None
    if os.geteuid() == 0:
        with contextlib.suppress(OSError):
            group = _make(name, cores)
    if group is None:
        yield CpuGroup((), cores)
        return
    try:
        yield CpuGroup(("sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh"), cores)
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()
