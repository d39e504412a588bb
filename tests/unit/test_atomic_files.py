"""The one way a file is replaced (atomic_files.py), and what a writer killed mid-write leaves behind."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

from noloco_node.atomic_files import remove_dead_writers_leftovers, write_atomically


def test_a_writer_killed_mid_write_leaves_no_temporary_file_for_ever(tmp_path: Path) -> None:
    """A checkpoint save killed mid-write (SIGKILL: no cleanup runs) left its temporary file for good, and a crash
    loop filled the disk. The next write of the same file removes what dead writers left, never a live one's."""
    target = tmp_path / "checkpoint.pt"
    killed = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, signal, sys\n"
            "from pathlib import Path\n"
            "from noloco_node.atomic_files import write_atomically\n"
            "def torn(handle):\n"
            "    handle.write(b'half a checkpoint')\n"
            "    handle.flush()\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "write_atomically(Path(sys.argv[1]), torn)\n",
            str(target),
        ]
    )
    killed.wait(60)
    leftovers = list(tmp_path.glob(".checkpoint.pt.*.tmp"))
    assert len(leftovers) == 1 and not target.exists()  # what the killed writer left
    # What a node that is PID 1 at every container start left in an earlier life: the name carries the PID of a
    # process that is alive now (this one), and nobody writes it.
    earlier_life = tmp_path / f".checkpoint.pt.{os.getpid()}.def.tmp"
    earlier_life.write_bytes(b"torn")
    live = tmp_path / ".checkpoint.pt.4242.abc.tmp"  # a writer still at work, whatever its PID
    live.write_bytes(b"in progress")
    for leftover in (*leftovers, earlier_life, live):
        os.utime(leftover, (time.time() - 60, time.time() - 60))  # older than a writer's first instant
    with open(live, "rb") as writer:
        fcntl.flock(writer.fileno(), fcntl.LOCK_EX)  # what a writer at work holds
        write_atomically(target, b"whole")
        assert target.read_bytes() == b"whole"
        assert sorted(tmp_path.glob(".checkpoint.pt.*.tmp")) == [live]
    write_atomically(target, b"again")  # its writer gone (the lock dropped): removed too
    assert list(tmp_path.glob(".checkpoint.pt.*.tmp")) == []


def test_a_temporary_file_just_created_is_left_to_its_writer(tmp_path: Path) -> None:
    """Between O_EXCL and flock a writer holds no lock: a file that young is never taken for a leftover."""
    fresh = tmp_path / ".status.json.7.abc.tmp"
    fresh.write_bytes(b"")
    assert remove_dead_writers_leftovers(tmp_path / "status.json") == []
    assert remove_dead_writers_leftovers(tmp_path / "status.json", min_age=0.0) == [fresh]
