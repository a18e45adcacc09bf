"""The kernel's DAP client of one rank's debugger, over the rank's signed relay
(engine/dap_relay.py; the link's rules in core/dap_frames.py). Runs on the control thread's
event loop, where ipykernel answers JupyterLab's debug requests."""

from __future__ import annotations

import asyncio
import json
import logging

from ..core import dap_frames

log = logging.getLogger("infini_notebook")

REPLY_TIMEOUT = 15.0  # seconds a rank's debugger may take to answer one request


class DapConnection:
    """Requests to one rank's debugger, and its events (``on_event(rank, message)``)."""

    def __init__(self, rank: int, on_event):
        self.rank, self.on_event = rank, on_event
        self.seq = 0
        self.pending: dict[int, asyncio.Future] = {}
        self.initialized = asyncio.Event()
        self.writer = self.task = self.out = None

    async def open(self, host: str, port: int, key: str) -> None:
        """Link to the relay: its hello, our signed answer (dap_frames: steps 1 and 2)."""
        reader, self.writer = await asyncio.open_connection(host, port)
        try:
            hello = await asyncio.wait_for(reader.readline(), REPLY_TIMEOUT)
            relay_nonce = dap_frames.parse_hello(hello)
        except (dap_frames.BadFrame, asyncio.TimeoutError) as e:
            self.writer.close()
            raise ConnectionError(f"rank {self.rank}'s debugger relay: {e}") from None
        answer, self.out, inbound = dap_frames.kernel_side(key, relay_nonce)
        self.writer.write(answer)
        self.task = asyncio.ensure_future(self._read(reader, inbound))

    @property
    def alive(self) -> bool:
        return self.task is not None and not self.task.done()

    def send(self, command: str, arguments: dict | None = None) -> asyncio.Future:
        self.seq += 1
        msg = {"seq": self.seq, "type": "request", "command": command}
        if arguments is not None:
            msg["arguments"] = arguments
        fut = asyncio.get_running_loop().create_future()
        self.pending[self.seq] = fut
        self.writer.write(self.out.pack(dap_frames.dap_message(msg)))
        return fut

    async def request(self, command: str, arguments: dict | None = None) -> dict:
        return await asyncio.wait_for(self.send(command, arguments), REPLY_TIMEOUT)

    async def _read(self, reader: asyncio.StreamReader, inbound: dap_frames.Direction) -> None:
        buffer = b""
        try:
            while True:
                length = dap_frames.frame_length(await reader.readexactly(dap_frames.HEADER))
                buffer += inbound.unpack(await reader.readexactly(length))
                messages, buffer = dap_frames.split_dap(buffer)
                for raw in messages:
                    self._dispatch(json.loads(raw[raw.index(b"\r\n\r\n") + 4 :]))
        except dap_frames.BadFrame as e:  # not the relay's: nothing more is believed
            log.warning("rank %s debugger link: %s; link closed", self.rank, e)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as e:
            log.debug("rank %s debugger link ended: %r", self.rank, e)
        finally:
            self.writer.close()
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(ConnectionError(f"rank {self.rank}'s debugger left"))

    def _dispatch(self, msg: dict) -> None:
        if msg.get("type") == "response":
            fut = self.pending.pop(msg.get("request_seq"), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif msg.get("type") == "event":
            if msg.get("event") == "initialized":
                self.initialized.set()
            self.on_event(self.rank, msg)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.task is not None:
            self.task.cancel()
