"""The one way this project replaces a file: write a temporary file beside it, fsync, rename over it, fsync the folder.

A crash at any moment leaves the old file or the new one, never a torn one: checkpoints, the node key, status.json
and shard.json all go through :func:`write_atomically`. The temporary file is created with the final file's mode
(``O_EXCL``), so a private file (the node key, 0600) is never readable by others, not even for an instant. A
process killed mid-write leaves its temporary file behind; the next write of the same file removes those of
writers that are no longer at work, so a crash loop does not fill the disk with torn checkpoints.

A writer holds an exclusive ``flock`` on its temporary file while it writes, and the kernel drops it when the
process dies, however it dies: a temporary file that can be locked has no writer. Not the writer's PID: in a
container the node is PID 1 at every start, so a PID says nothing about whether the file's writer is alive.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

# Seconds a temporary file is left alone whatever its lock says: between creating it and locking it, a writer
# holds no lock yet.
LEFTOVER_MIN_AGE = 10.0


def write_atomically(
    path: Path, content: bytes | str | Callable[[BinaryIO], None], *, mode: int = 0o644, durable: bool = True
) -> None:
    """Replace ``path`` with ``content`` (bytes, text, or a function that writes to the open file).

    ``durable`` fsyncs the file and its folder (checkpoints, keys); status files that are rewritten every few
    seconds skip it: a crash may lose the latest version but never leaves a torn one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_writers_leftovers(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{id(content):x}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held until the file is closed, or the process dies
        with os.fdopen(fd, "wb") as handle:
            if callable(content):
                content(handle)
            else:
                handle.write(content.encode() if isinstance(content, str) else content)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def remove_dead_writers_leftovers(path: Path, *, min_age: float = LEFTOVER_MIN_AGE) -> list[Path]:
    """Delete the temporary files of ``path`` that no writer holds (their writer was killed mid-write); returns
    them. One that a writer holds, in this process or another, is left alone, and so is one younger than
    ``min_age`` seconds: its writer may not have taken its lock yet."""
    removed = []
    now = time.time()
    for leftover in path.parent.glob(f".{path.name}.*.tmp"):
        try:
            if now - leftover.stat().st_mtime < min_age:
                continue
            fd = os.open(leftover, os.O_RDONLY)
        except FileNotFoundError:  # its writer renamed it meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a writer at work
            continue
        finally:
            os.close(fd)
        leftover.unlink(missing_ok=True)
        removed.append(leftover)
    return removed
