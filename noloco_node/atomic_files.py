"""The one way this project replaces a file: write a temporary file beside it, fsync, rename over it, fsync the folder.

A crash at any moment leaves the old file or the new one, never a torn one: checkpoints, the node key, status.json
and shard.json all go through :func:`write_atomically`. The temporary file is created with the final file's mode
(``O_EXCL``), so a private file (the node key, 0600) is never readable by others, not even for an instant. A
process killed mid-write leaves its temporary file behind; the next write of the same file removes those of
writers that are no longer alive, so a crash loop does not fill the disk with torn checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


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


def remove_dead_writers_leftovers(path: Path) -> list[Path]:
    """Delete the temporary files of ``path`` whose writing process is gone (killed mid-write); returns them. A
    live writer's (this process's or another's) is left alone."""
    removed = []
    for leftover in path.parent.glob(f".{path.name}.*.tmp"):
        pid = leftover.name[len(path.name) + 2 :].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            leftover.unlink(missing_ok=True)
            removed.append(leftover)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, and someone else's
        return True
    return True
