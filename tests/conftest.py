"""Shared test set-up: a private corpus cache per test session, so tests never depend on the user's cache."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    if "NOLOCO_CACHE_DIR" not in os.environ:
        os.environ["NOLOCO_CACHE_DIR"] = tempfile.mkdtemp(prefix="noloco-test-cache-")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
