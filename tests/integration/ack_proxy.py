"""A user-space TCP proxy in front of a node's gRPC port that loses an exchange's acknowledgement in flight: it
reads the HTTP/2 frames of plain-text gRPC both ways, and on ``drops`` exchanges whose caller sends a stream run's
progress payload, after the first ``skip`` such exchanges, it forwards everything up to the server's
acknowledgement (the verdict frame after its payload), withholds that frame and what follows, and closes the
caller's connection. The server has blended by then; the caller has committed and hears nothing (rpc/client.py
``UNACKNOWLEDGED``). Everything else, other calls included, is forwarded as it is."""

from __future__ import annotations

import asyncio

from google.protobuf.message import DecodeError

from noloco_node.wire import peer_pb2 as pb

from .throttling_proxy import LoopbackProxy

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA = 0x0
PADDED = 0x8


class _Messages:
    """The gRPC messages of one HTTP/2 stream, from its DATA frames' payloads."""

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, payload: bytes) -> list[bytes]:
        self.buffer += payload
        messages = []
        while len(self.buffer) >= 5:
            length = int.from_bytes(self.buffer[1:5], "big")
            if len(self.buffer) < 5 + length:
                break
            messages.append(self.buffer[5 : 5 + length])
            self.buffer = self.buffer[5 + length :]
        return messages


def _data_payload(flags: int, payload: bytes) -> bytes:
    if flags & PADDED and payload:
        return payload[1 : len(payload) - payload[0]]
    return payload


def _frame(message: bytes) -> pb.Frame | None:
    try:
        return pb.Frame.FromString(message)
    except DecodeError:  # another method's message (Info)
        return None


class AckDroppingProxy(LoopbackProxy):
    """Listens on 127.0.0.1:<port> and forwards to 127.0.0.1:<target_port>, losing ``drops`` progress acks after
    ``skip`` progress exchanges."""

    def __init__(self, target_port: int, *, skip: int = 0, drops: int) -> None:
        self.skip_left = skip
        self.drops_left = drops
        self.dropped = 0
        super().__init__(target_port)

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_writer.close()
            return
        progress_streams: set[int] = set()  # the streams of this connection whose ack is to be lost
        try:
            await asyncio.gather(
                self._from_client(client_reader, server_writer, progress_streams),
                self._from_server(server_reader, client_writer, progress_streams),
            )
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            client_writer.close()
            server_writer.close()

    async def _from_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, progress_streams: set[int]
    ) -> None:
        writer.write(await reader.readexactly(len(PREFACE)))
        streams: dict[int, _Messages] = {}
        while True:
            header = await reader.readexactly(9)
            payload = await reader.readexactly(int.from_bytes(header[:3], "big"))
            kind, flags, stream = header[3], header[4], int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
            if kind == DATA:
                messages = streams.setdefault(stream, _Messages()).feed(_data_payload(flags, payload))
                for message in messages:
                    frame = _frame(message)
                    manifest = frame.manifest if frame is not None and frame.HasField("manifest") else None
                    progress = manifest is not None and any(t.name.startswith("progress/") for t in manifest.tensors)
                    if progress:
                        progress_streams.add(stream)
            writer.write(header + payload)
            await writer.drain()

    async def _from_server(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, progress_streams: set[int]
    ) -> None:
        streams: dict[int, _Messages] = {}
        while True:
            header = await reader.readexactly(9)
            payload = await reader.readexactly(int.from_bytes(header[:3], "big"))
            kind, flags, stream = header[3], header[4], int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
            if kind == DATA and stream in progress_streams:
                for message in streams.setdefault(stream, _Messages()).feed(_data_payload(flags, payload)):
                    frame = _frame(message)
                    if frame is None or not frame.HasField("verdict"):
                        continue
                    if self.skip_left > 0:  # an acknowledgement that reaches the caller (or a refusal)
                        self.skip_left -= 1
                    elif self.drops_left > 0:
                        self.drops_left -= 1
                        # Lost: the caller hears nothing more on this connection. What the server still sends
                        # is read and dropped, so that its side of the call ends as if delivered.
                        self.dropped += 1
                        writer.close()
                        while await reader.read(65536):
                            pass
                        return
            writer.write(header + payload)
            await writer.drain()
