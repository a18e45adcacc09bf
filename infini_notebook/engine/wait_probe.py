"""Engine side: what this rank's cell is waiting in right now, read from a helper thread
while the cell's thread blocks in torch.distributed (torch releases the GIL there), and
releasing such waits when the kernel finds they can never finish.

The cell thread's frames give the call (``all_reduce``, ``recv``...), its group object and
peer, and the cell line it came from, on any backend; torch's Flight Recorder, where it is
recording, adds the collective's sequence number in its group. The kernel compares what
the ranks report (see ``waits.py``, pure).
"""

from __future__ import annotations

import json
import os
import sys
import threading

# Flight Recorder keeps this many entries per rank when the engine sets TORCH_FR_BUFFER_SIZE
# before its process groups are made (torch reads it then); a few KB.
FLIGHT_RECORDER_ENTRIES = 200

# torch.distributed calls a cell can block in, and the argument naming the other rank.
_PEER_ARG = {"send": "dst", "recv": "src", "isend": "dst", "irecv": "src"}
_CALLS = frozenset(
    {
        "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
        "all_gather_object", "gather", "gather_object", "scatter", "scatter_object_list",
        "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
        "barrier", "monitored_barrier", "broadcast_object_list", "send", "recv",
        "send_object_list", "recv_object_list", "batch_isend_irecv",
    }
)  # fmt: skip
_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")
_CELL_FILE_MARKS = ("ipykernel_", "<ipython-input-")


def flight_recorder_env(torch_version: str) -> dict[str, str]:
    """Variables that turn the Flight Recorder on. torch 2.11 and 2.13 read TORCH_FR_BUFFER_SIZE
    and warn on the old NCCL name (FlightRecorder.hpp: getCvarInt({"TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_BUFFER_SIZE"})), a C++ warning every rank printed at its first group;
    torch before 2.10 reads only the old name."""
    n = str(FLIGHT_RECORDER_ENTRIES)
    major, minor = (int(p) for p in torch_version.split(".")[:2])
    if (major, minor) >= (2, 10):
        return {"TORCH_FR_BUFFER_SIZE": n}
    return {"TORCH_FR_BUFFER_SIZE": n, "TORCH_NCCL_TRACE_BUFFER_SIZE": n}


def current_wait(cell_started_ns: int | None = None) -> dict | None:
    """The torch.distributed call the main (cell) thread is in, or None (computing, idle).
    Keys: op, group (its label), ranks (the group's global ranks), peer (send/recv),
    seq (the collective's number in its group, from the Flight Recorder), nth (which of the
    cell's calls of that op on that group, counted from ``cell_started_ns``, on
    time.time_ns()'s clock: cell_end.started_ns()), line, func."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    call, cell = None, []
    while frame is not None:
        code = frame.f_code
        if call is None and code.co_name in _CALLS and code.co_filename.endswith(_C10D_FILE):
            call = frame  # the innermost: a collective may call others (object ones do)
        if any(mark in code.co_filename for mark in _CELL_FILE_MARKS):
            cell.append(frame)
        frame = frame.f_back
    if call is None:  # NCCL returns at once; the cell then blocks in a sync (x.item())
        return _pending_in_flight_recorder(cell_started_ns)
    wait = _describe_call(call, cell_started_ns)
    if cell:  # innermost cell frame: the user's line; outermost: the running cell itself
        wait["line"] = cell[0].f_lineno
        wait["in_cell"] = cell[0].f_code.co_filename == cell[-1].f_code.co_filename
        wait["func"] = cell[0].f_code.co_name
    return wait


def _describe_call(frame, cell_started_ns: int | None = None) -> dict:
    import torch.distributed as dist

    op = frame.f_code.co_name
    local = frame.f_locals
    group = local.get("group")
    pg = group if group is not None else dist.group.WORLD
    try:
        ranks = dist.get_process_group_ranks(pg)
    except Exception:  # a destroyed group, or not a process group
        ranks = []
    wait = {"op": op, "group": group_label(pg), "ranks": ranks, "peer": None, "seq": None}
    if op in _PEER_ARG:
        peer = local.get(_PEER_ARG[op])
        if peer is None and local.get(f"group_{_PEER_ARG[op]}") is not None:
            peer = ranks[local[f"group_{_PEER_ARG[op]}"]] if ranks else None
        wait["peer"] = peer
    else:
        wait.update(_numbers(pg, cell_started_ns))
    return wait


def group_label(pg) -> str:
    """'world', the layout's kind ('tp', 'cp-dp': our groups are made with group_desc
    'inb_<kind>'), or the group's ranks."""
    import torch.distributed as dist

    if pg is None or pg == dist.group.WORLD:
        return "world"
    desc = getattr(pg, "group_desc", "") or ""
    if desc.startswith("inb_"):
        from ..core.recorder import group_label as desc_label

        return desc_label(desc)
    try:
        return f"the group of ranks {dist.get_process_group_ranks(pg)}"
    except Exception:
        return "a group"


def _numbers(pg, cell_started_ns: int | None) -> dict:
    """The newest collective this rank enqueued on ``pg``, by the Flight Recorder: its
    number in the group (seq) and among the cell's calls of its kind there (nth)."""
    from ..core import recorder

    dump = flight_recorder_dump(only_active=False)
    entry = recorder.newest_entry(dump, getattr(pg, "group_name", None)) if dump else None
    if entry is None:
        return {"seq": None}
    nth = recorder.nth_in_cell(dump, entry, cell_started_ns, FLIGHT_RECORDER_ENTRIES)
    return {"seq": entry["collective_seq_id"], "nth": nth}


def flight_recorder_dump(entries: bool = True, only_active: bool = True) -> dict | None:
    """This rank's Flight Recorder, from the recorder its backend writes to; None when no
    recorder records here. torch 2.13 keeps two: NCCL work goes to the NCCL recorder
    (``dump_nccl_trace_json``, ProcessGroupNCCL.hpp, bound as ``_dump_nccl_trace_json`` in
    c10d/init.cpp only where USE_C10D_NCCL is built, so never on a CPU wheel), gloo and CPU
    work to the generic one (``dump_fr_trace_json``, FlightRecorder.hpp). Both take
    (includeCollectives, onlyActive): by default only what is not completed, to keep the
    dump small (``only_active=False``: all it holds, for %%dist_profile); without
    ``entries``, the groups' status alone."""
    import torch
    import torch.distributed as dist

    c10d = torch._C._distributed_c10d
    nccl = dist.is_initialized() and "nccl" in str(dist.get_backend())
    dump = getattr(c10d, "_dump_nccl_trace_json", None) if nccl else None
    dump = dump or getattr(c10d, "_dump_fr_trace_json", None)
    try:
        return json.loads(dump(entries, only_active)) if dump is not None else None
    except Exception:  # not recording (no buffer size set), or a build without it
        return None


def tcp_links() -> list[list]:
    """This process's established TCP connections as [local, remote] (host, port) pairs."""
    import psutil

    return [
        [[_host(c.laddr.ip), c.laddr.port], [_host(c.raddr.ip), c.raddr.port]]
        for c in psutil.Process().net_connections("tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.raddr
    ]


def _host(ip: str) -> str:
    return ip.removeprefix("::ffff:")  # an IPv4 peer seen through an IPv6 socket


def _pending_in_flight_recorder(cell_started_ns: int | None = None) -> dict | None:
    """The oldest collective the Flight Recorder holds as pending (see core/recorder.py):
    NCCL calls return at once and the cell then blocks in a sync (``x.item()``), and a gloo
    cell may wait in ``work.wait()`` of an ``async_op`` collective."""
    import torch.distributed as dist

    from ..core import recorder

    if not dist.is_initialized():
        return None
    dump = flight_recorder_dump(only_active=False)  # all: the cell's earlier calls number it
    entry = recorder.oldest_pending(dump) if dump else None
    if entry is None:
        return None
    wait = recorder.describe(dump, entry)
    wait["nth"] = recorder.nth_in_cell(dump, entry, cell_started_ns, FLIGHT_RECORDER_ENTRIES)
    name = wait.pop("name")
    if not wait["ranks"]:  # pg_config may not name the group's ranks
        wait["ranks"] = _group_ranks(name, wait["group"])
    return wait


def _group_ranks(name: str, label: str) -> list[int]:
    """The global ranks of the live process group named ``name`` (c10d's registry)."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    if label == "world":
        return list(range(dist.get_world_size()))
    for pg, pg_name in list(getattr(c10d._world, "pg_names", {}).items()):
        if pg_name == name:
            try:
                return dist.get_process_group_ranks(pg)
            except Exception:
                return []
    return []


def close_peer_links(peer_links: list[list] | None) -> int:
    """Shut down this process's TCP connections to the waiting peers (``peer_links``: their
    tcp_links, as seen from their side): a gloo group object still referenced (by ``groups``,
    a DDP module, a saved frame) keeps its sockets open after a destroy, and only a closed
    connection ends a gloo wait ('Connection closed by peer'). Returns how many it closed."""
    import socket

    import psutil

    theirs = {(tuple(r), tuple(lo)) for lo, r in peer_links or []}  # as seen from here
    closed = 0
    for c in psutil.Process().net_connections("tcp"):
        if not c.raddr or c.fd < 0:
            continue
        mine = ((_host(c.laddr.ip), c.laddr.port), (_host(c.raddr.ip), c.raddr.port))
        if mine in theirs:
            try:
                with socket.socket(fileno=os.dup(c.fd)) as sock:
                    # The fd may have been closed and reused since it was listed (new groups
                    # being made beside this thread): end it only if it is still that link.
                    if (_address(sock.getsockname()), _address(sock.getpeername())) != mine:
                        continue
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed meanwhile (by the peer, or by gloo): one less to close
                continue
            closed += 1
    return closed


def _address(addr: tuple) -> tuple[str, int]:
    return _host(addr[0]), addr[1]  # IPv6 addresses come with flow and scope too


_aborted: list[bool] = []  # not empty once this process aborted its communicators


def aborted_before() -> bool:
    """Whether this process has aborted NCCL communicators (see bootstrap.init_distributed)."""
    return bool(_aborted)


def abort_groups() -> None:
    """Abort this rank's NCCL communicators, from any thread: a collective waiting in
    them raises (with TORCH_NCCL_ASYNC_ERROR_HANDLING set, instead of ending the process)."""
    import torch.distributed as dist

    _aborted.append(True)
    c10d = dist.distributed_c10d
    try:  # every group at once, inside one ncclGroupStart/End (torch issue 119797)
        c10d._abort_process_group()
        return
    except Exception:
        pass
    for pg in list(getattr(c10d._world, "pg_map", {})):
        try:
            pg.abort()
        except Exception:
            pass
