"""Less work per message in each engine's ipykernel. An empty cell costs an engine ~2 ms
of CPU, almost all of it ipykernel's message handling, not the cell; with 16 ranks on a
few cores that is most of the cell's latency (benchmarks/bench_latency.py). Each trim
here keeps what the kernel reads and leaves ipykernel alone where its internals are not
the ones we know (``apply`` checks before it patches)."""

from __future__ import annotations

import functools
import logging

from ..core import internals

_KERNEL_PARTS = ("_publish_status", "_publish_execute_input", "log")
_STREAM_PARTS = ("_flush_pending", "_buffers", "flush", "_flush")


def apply() -> list[str]:
    """Trim what this engine's ipykernel allows; returns the trims in place. One whose
    internals are not the ones we know is skipped with a log line (stock speed)."""
    from IPython import get_ipython

    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is None:
        return []
    applied = []
    if internals.usable(kernel, _KERNEL_PARTS, "ipykernel", "Kernel message publishing"):
        _skip_unread_iopub(kernel)
        kernel.log.setLevel(logging.WARNING)  # was DEBUG: a record built per message, dropped
        applied += ["no busy/execute_input", "no debug log"]
    if _flush_only_pending_output():
        applied.append("flush only pending")
    if _remember_signature_checks():
        applied.append("signature checks remembered")
    return applied


def in_effect() -> dict[str, bool]:
    """Each trim, looked up on the live objects: whether it is in place now."""
    import sys

    from IPython import get_ipython

    kernel = get_ipython().kernel
    try:
        from ipykernel import ipkernel
    except ImportError:
        ipkernel = None
    return {
        "no busy/execute_input": getattr(kernel._publish_status, "__name__", "")
        == "publish_unless_busy",
        "no debug log": kernel.log.level == logging.WARNING,
        "flush only pending": all(
            getattr(s.flush, "__name__", "") == "flush_if_pending" for s in (sys.stdout, sys.stderr)
        ),
        "signature checks remembered": hasattr(
            getattr(ipkernel, "_accepts_parameters", None), "cache_info"
        ),
    }


def _skip_unread_iopub(kernel) -> None:
    """No 'busy' status and no execute_input on iopub: ipyparallel's client waits for
    'idle' only, and the kernel knows the code it sent. Each is one message per rank per
    cell for the engine, the controller and the client."""
    publish_status = kernel._publish_status

    def publish_unless_busy(status, channel, parent=None):
        if status != "busy":
            publish_status(status, channel, parent)

    kernel._publish_status = publish_unless_busy
    kernel._publish_execute_input = lambda *args, **kwargs: None


def _flush_only_pending_output() -> bool:
    """ipykernel flushes stdout and stderr twice per request, each time waiting for its
    iopub thread to come round (a thread switch, slow on a loaded machine), even when the
    cell wrote nothing. Skip the flush when nothing is buffered and no flush is under way.

    Ordering is what the stock flush guarantees: its wait ends only once the iopub thread
    has queued every send of a flush it was in the middle of, so the 'idle' status, queued
    later, goes after all output. A flush under way has taken the buffers and cleared
    ``_flush_pending`` before it queues its sends (iostream.OutStream._flush): skipping
    then let 'idle' overtake the tail of a flood, and the kernel, done at 'idle', lost it
    (issue 34, item 6: 7,000 of 200,000 lines under load). So a flush under way counts."""
    import sys

    streams = [sys.stdout, sys.stderr]
    if not all(internals.usable(s, _STREAM_PARTS, "ipykernel", "OutStream") for s in streams):
        return False
    for stream in streams:
        flush, send = stream.flush, stream._flush
        under_way = [0]  # _flush runs on the iopub thread (a timer or a flush's request)

        def counted_send(send=send, under_way=under_way) -> None:
            under_way[0] += 1
            try:
                send()
            finally:
                under_way[0] -= 1

        def flush_if_pending(stream=stream, flush=flush, under_way=under_way) -> None:
            if (
                under_way[0]
                or stream._flush_pending
                or any(b.tell() for b in list(stream._buffers.values()))
            ):
                flush()

        stream._flush = counted_send  # looked up when scheduled: every later flush counts
        stream.flush = flush_if_pending
    return True


def _remember_signature_checks() -> bool:
    """ipykernel inspects ``run_cell``'s signature on every request (~15 % of an empty
    cell's engine time); the answer does not change while the method is the same."""
    try:
        from ipykernel import ipkernel
    except ImportError:
        return False
    if not internals.usable(ipkernel, ("_accepts_parameters",), "ipykernel", "ipkernel"):
        return False
    check = ipkernel._accepts_parameters
    if hasattr(check, "cache_info"):
        return True

    @functools.lru_cache(maxsize=32)
    def remembered(meth, names: tuple) -> dict:
        return check(meth, list(names))

    def accepts_parameters(meth, param_names):
        return dict(remembered(meth, tuple(param_names)))

    accepts_parameters.cache_info = remembered.cache_info
    ipkernel._accepts_parameters = accepts_parameters
    return True
