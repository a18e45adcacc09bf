"""A relayed cell as ``kernel/cell.Cell`` reads ipyparallel's (launch/relay.py fills it):
one future per rank, shaped as ipyparallel 9.2's ``MessageFuture`` (``iopub_callbacks``,
an ``output`` future holding its ``Metadata`` keys), and the AsyncResult's ``_children``."""

from __future__ import annotations

import concurrent.futures


class RankFuture(concurrent.futures.Future):
    """One rank's part of a relayed cell, shaped as ipyparallel's MessageFuture: resolves
    on the reply; ``output`` resolves on status idle and holds what the rank published in
    ``output.metadata`` (ipyparallel's ``Metadata`` keys)."""

    def __init__(self, msg_id: str, engine_id: int):
        super().__init__()
        self.msg_id = msg_id
        self.iopub_callbacks: list = []
        self.output: concurrent.futures.Future = concurrent.futures.Future()
        self.output.metadata = new_metadata(msg_id, engine_id)
        # read when the cell is forgotten, without the futures' locks (2,048 lock round
        # trips per cell at 1,024 ranks); written on the link's thread
        self.replied = self.idled = False

    # Filled as ipyparallel 9.2's client fills its own (``Client._handle_execute_reply``,
    # ``_dispatch_iopub``); ``unwrap``: the client's ``unwrap_exception``.
    def reply(self, content: dict, unwrap) -> None:
        from ipyparallel import error
        from ipyparallel.client.client import ExecuteReply

        md = self.output.metadata
        md["status"] = content.get("status")
        if content.get("status") == "ok":
            result = ExecuteReply(self.msg_id, content, md)
        elif content.get("status") == "aborted":
            result = error.TaskAborted(self.msg_id)
            self.idle()  # an aborted request publishes nothing more
        else:
            result = unwrap(content)
        if not self.done():
            self.set_result(result)
        self.replied = True

    def idle(self) -> None:
        if not self.output.done():
            self.output.set_result(None)
        self.idled = True

    @property
    def ended(self) -> bool:
        """Replied and idle: nothing more comes for this rank's part."""
        return self.replied and self.idled

    def fail(self, error: BaseException) -> None:
        """The rank's part ends without its answers (its engine or its relay left)."""
        if not self.done():
            self.set_result(error)
        self.replied = True
        self.idle()

    def stream(self, name: str, text: str) -> None:
        md = self.output.metadata
        md[name] = (md[name] or "") + text
        self.publish({"header": {"msg_type": "stream"}, "content": {"name": name, "text": text}})

    def message(self, msg: dict, unwrap) -> None:
        """A rank's message as it came (what the relay's ``pack`` does not shorten)."""
        kind = msg["header"].get("msg_type")
        content = msg["content"]
        md = self.output.metadata
        if kind == "execute_reply":
            self.reply(content, unwrap)
            return
        if kind == "display_data":
            md["outputs"].append(content)
        elif kind == "execute_result":
            md["execute_result"] = content
        elif kind == "error":
            md["error"] = unwrap(content)
        self.publish(msg)

    def publish(self, msg: dict) -> None:
        for callback in list(self.iopub_callbacks):
            callback(msg)


def new_metadata(msg_id: str, engine_id: int) -> dict:
    """A rank's record of a cell, with the keys of ipyparallel's ``client.Metadata``."""
    return {
        "msg_id": msg_id, "submitted": None, "started": None, "completed": None,
        "received": None, "engine_uuid": None, "engine_id": engine_id, "follow": None,
        "after": None, "status": None, "execute_input": None, "execute_result": None,
        "error": None, "stdout": "", "stderr": "", "outputs": [], "data": {}, "label": None,
    }  # fmt: skip


class RelayedCell:
    """What ``Cell`` reads of ipyparallel's AsyncResult: one future per rank."""

    def __init__(self, msg_id: str, frames: list[bytes], futures: dict[int, RankFuture]):
        self.msg_id, self.frames, self.futures = msg_id, frames, futures
        self._children = list(futures.values())
        self.msg_ids: list[str] = []  # nothing of ipyparallel's to forget


def engine_error(text: str):
    """ipyparallel's answer for a task whose engine went away (``error.EngineError``)."""
    from ipyparallel import error

    return error.EngineError(text)
