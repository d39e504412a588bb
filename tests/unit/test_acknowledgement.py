"""rpc/client.py: how the caller reads the end of an exchange after its commit. The server said no (its round closed:
busy, nothing failed), ended the call on purpose (a refusal: not committed), or the call ended otherwise (in doubt:
unacknowledged: the server may have blended, this side does not)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from noloco_node.rpc.client import UNACKNOWLEDGED, ExchangeError, _acknowledged
from noloco_node.wire.frames import verdict_frame


class _Ended(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "ended"


class _Call:
    cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def _responses(*items: bytes | BaseException) -> Iterator[bytes]:
    for item in items:
        if isinstance(item, BaseException):
            raise item
        yield item


def _reason(*items: bytes | BaseException) -> str | None:
    try:
        _acknowledged(_responses(*items), _Call(), "peer")
    except ExchangeError as error:
        return error.reason
    return None


def test_an_acknowledgement_is_a_blend_on_both_sides() -> None:
    assert _reason(verdict_frame(commit=True)) is None


def test_a_round_that_closed_before_the_commit_is_busy_not_a_failure() -> None:
    assert _reason(verdict_frame(commit=False, reason="this node's round closed before the commit")) == "busy"


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.ABORTED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION]
)
def test_a_status_the_server_sent_on_purpose_is_not_committed(code: grpc.StatusCode) -> None:
    assert _reason(_Ended(code)) == "not_committed"
    assert _reason() == "not_committed"  # the server ended the stream without a word


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED]
)
def test_a_call_cut_after_the_commit_is_in_doubt(code: grpc.StatusCode) -> None:
    assert _reason(_Ended(code)) == UNACKNOWLEDGED
    assert _reason(b"\x00garbled") == UNACKNOWLEDGED
