"""Fixtures shared by the integration tests."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest

from .swarm_harness import Bootstrap


@pytest.fixture(scope="session")
def _bootstrap_peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bootstrap]:
    """One real `noloco-node bootstrap` process on 127.0.0.1 for the whole session: a swarm's rendezvous, as one
    long-lived bootstrap serves many runs in a real deployment (each start cost the tests 3 s)."""
    peer = Bootstrap(tmp_path_factory.mktemp("bootstrap"))
    yield peer
    peer.stop()


@pytest.fixture
def bootstrap(_bootstrap_peer: Bootstrap, request: pytest.FixtureRequest) -> Bootstrap:
    """The session's bootstrap peer, seen by one test: its nodes join under a run name of their own, so no record of
    another test's nodes (a killed node's stays until its TTL) is ever under their fingerprint. A bootstrap that died
    is replaced, so one test's failure cannot fail the next ones."""
    if _bootstrap_peer.process.poll() is not None:
        _bootstrap_peer.restart()
    run_name = "test-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]
    return _bootstrap_peer.for_run(run_name)
