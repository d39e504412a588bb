"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .swarm_harness import Bootstrap


@pytest.fixture
def bootstrap(tmp_path: Path) -> Iterator[Bootstrap]:
    """A real `noloco-node bootstrap` process on 127.0.0.1 for one test's swarm."""
    peer = Bootstrap(tmp_path)
    yield peer
    peer.stop()
