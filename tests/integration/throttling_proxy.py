"""A user-space TCP proxy for fault injection on loopback: forwards to a target at a limited rate, counts bytes,
lets a test act once a connection has carried a given number of bytes, and can cut every connection after a given
number of bytes, mid-message (this kernel has no netem)."""

from __future__ import annotations

import asyncio
import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LoopbackProxy(ABC):
    """Listens on 127.0.0.1:<port> and hands each connection to ``_handle`` (a subclass forwards it to
    127.0.0.1:<target_port> its own way), on an event loop of its own in a daemon thread. A subclass sets its own
    fields before calling ``__init__``: connections may come as soon as it returns."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._started.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._started.set()
        self._loop.run_forever()

    @abstractmethod
    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        """One connection from a client, forwarded to the target in this proxy's way."""

    def _cancel_relays(self) -> None:
        """On the proxy's loop: end every relayed connection."""

        async def cancel() -> None:
            relays = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in relays:
                task.cancel()
            await asyncio.gather(*relays, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel(), self._loop).result(timeout=5)

    def close(self) -> None:
        """Stop listening and end every relayed connection on the proxy's loop before stopping it: a loop stopped
        with relays still pending left their coroutines to be closed later, on a closed loop."""
        self._loop.call_soon_threadsafe(self._server.close)
        self._cancel_relays()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


class ThrottlingProxy(LoopbackProxy):
    """Listens on 127.0.0.1:<port> and forwards to 127.0.0.1:<target_port> at ``bytes_per_second`` per direction."""

    def __init__(
        self,
        target_port: int,
        *,
        bytes_per_second: int,
        on_bytes: Callable[[int], None] | None = None,
        cut_after_bytes: int | None = None,
    ):
        self.cut_after_bytes = cut_after_bytes
        self.cuts = 0
        self.rate = bytes_per_second
        self.on_bytes = on_bytes
        self.relayed = 0
        self.refusing = False  # interrupt(): the path is broken, connections are accepted and closed at once
        super().__init__(target_port)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, other: asyncio.StreamWriter
    ) -> None:
        carried = 0
        try:
            while True:
                data = await reader.read(16384)
                if not data:
                    break
                if self.cut_after_bytes is not None and carried + len(data) > self.cut_after_bytes:
                    writer.write(data[: self.cut_after_bytes - carried])  # the cut falls inside a message
                    self.cuts += 1
                    other.close()
                    break
                carried += len(data)
                writer.write(data)
                await writer.drain()
                self.relayed += len(data)
                if self.on_bytes is not None:
                    self.on_bytes(self.relayed)
                await asyncio.sleep(len(data) / self.rate)
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            client_writer.close()
            return
        try:
            target_reader, target_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(
            self._pipe(client_reader, target_writer, client_writer),
            self._pipe(target_reader, client_writer, target_writer),
        )

    def interrupt(self) -> None:
        """Break the path: every relayed connection is cut and new ones are closed as they come, until restore()."""
        self.refusing = True
        self._cancel_relays()

    def restore(self) -> None:
        self.refusing = False
