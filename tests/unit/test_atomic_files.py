"""The one way a file is replaced (atomic_files.py), and what a writer killed mid-write leaves behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from noloco_node.atomic_files import write_atomically


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
    live = tmp_path / f".checkpoint.pt.{os.getpid()}.abc.tmp"  # a writer of this process, still at work
    live.write_bytes(b"in progress")
    write_atomically(target, b"whole")
    assert target.read_bytes() == b"whole"
    assert sorted(tmp_path.glob(".checkpoint.pt.*.tmp")) == [live]
