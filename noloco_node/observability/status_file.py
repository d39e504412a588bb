"""``status.json`` in a node's data directory: the same document as ``GET /status``, for launchers, benchmarks
and post-mortems. The node writes it atomically after every outer step; this module is the one place that writes
or reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from noloco_node.atomic_files import write_atomically

STATUS_FILE = "status.json"


def write_status_file(data_dir: Path, status: BaseModel) -> None:
    # Rewritten at every outer step: atomic (never torn), not fsynced (a crash may only lose the latest one).
    write_atomically(data_dir / STATUS_FILE, status.model_dump_json(), durable=False)


def read_status_document(data_dir: Path) -> dict[str, Any] | None:
    """The node's last status as plain JSON, or None while there is none (not started yet, or unreadable)."""
    try:
        document = json.loads((data_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) else None
