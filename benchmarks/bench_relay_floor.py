"""The kernel's floor for a cell sent through one relay per host (issue 54's plan, not built):
what the kernel would still spend per cell once ranks' replies come packed per host.

    .venv/bin/python benchmarks/bench_relay_floor.py [--ranks 256 1024] [--hosts 16]
        [--cells 20]

Real here: the kernel's side of a cell past the network, as the plan keeps it: one signed
message per host each way over zmq (``core/signing``'s HMAC, JSON), each rank's reply
date read by the session's parser (``launch/reply_dates``), one future per rank resolved
with its reply and output, and the cell's output handling, the very ``kernel/cell.Cell``
a session uses (``StreamLabeler``, ``TextPrinter``, rank order, the final render), with each
rank's output file (``kernel/output_files.OutputFiles`` in a temporary folder), under
``gc_pace``. Played by a second process: the hosts' relays, answering each cell with one
packed message per host (every rank's reply, and its line for the print cell). Left out:
the ranks, the relays' own work, ipyparallel's client and controller (which the plan takes
off the cell's path), and the kernel's supervision of a running cell
(``kernel/watch.CellWatch``'s liveness and store polls) and most of ``execution.collect``
(docs/scale.md).

Per size: ``floor_cpu_ms`` / ``floor_wall_ms`` (an empty cell: this process's CPU, every
thread, and its wall time; checked: nothing shown), ``floor_print_cpu_ms`` /
``floor_print_wall_ms`` (every rank prints one line; checked by bench_scale's oracle: each
rank's line, labeled, once, in rank order). Medians over ``--cells``. The last line is one
JSON object keyed by size.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench_scale import check_empty_cell, check_print_cell, positive

from infini_notebook.core import signing

# The hosts' relays: for each host's signed copy of a cell, that host's signed packed reply.
RELAYS = """\
import json, sys, zmq
from infini_notebook.core import signing
key, n, hosts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ctx = zmq.Context()
down, up = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
down.connect(f"tcp://127.0.0.1:{sys.argv[4]}"); up.connect(f"tcp://127.0.0.1:{sys.argv[5]}")
per = -(-n // hosts)
while True:
    raw = down.recv()
    if raw == b"end":
        break
    cell = json.loads(signing.verify(key, "cell", raw))
    ranks = range(cell["host"] * per, min(n, (cell["host"] + 1) * per))
    body = json.dumps([
        {"rank": r, "status": "ok", "execution_count": cell["count"],
         "started": "2026-11-28T09:00:00.123456Z", "completed": "2026-11-28T09:00:00.2Z",
         "stdout": f"hello from {r}\\n" if cell["print"] else ""}
        for r in ranks
    ])
    up.send(signing.sign(key, "reply", body.encode()))
"""


class _Output(concurrent.futures.Future):
    """A rank's output: done when its last message came (as ipyparallel's ``output``)."""

    def __init__(self):
        super().__init__()
        self.metadata = {"stdout": "", "stderr": "", "outputs": []}


class _RankFuture(concurrent.futures.Future):
    """What ``Cell`` reads of ipyparallel's MessageFuture, and no more."""

    def __init__(self, msg_id: str):
        super().__init__()
        self.msg_id, self.iopub_callbacks, self.output = msg_id, [], _Output()


class _Cell:
    def __init__(self, n: int, count: int):
        self._children = [_RankFuture(f"{count}-{r}") for r in range(n)]
        self.msg_ids = [f.msg_id for f in self._children]


def _unpack(key: str, raw: bytes, ar: _Cell, parse_date) -> None:
    """One host's packed reply: each rank's output to its callbacks, then its reply."""
    body = signing.verify(key, "reply", raw)
    if body is None:
        raise AssertionError("a packed reply with a bad signature")
    for rec in json.loads(body):
        f = ar._children[rec["rank"]]
        f.output.metadata["started"] = parse_date(rec["started"])
        if rec["stdout"]:
            msg = {"header": {"msg_type": "stream"}, "content": {"name": "stdout"}}
            msg["content"]["text"] = rec["stdout"]
            f.output.metadata["stdout"] += rec["stdout"]
            for callback in f.iopub_callbacks:
                callback(msg)
        f.set_result(rec)
        f.output.set_result(None)


def one_cell(socks, key: str, n: int, hosts: int, count: int, printing: bool, folder: str):
    """One cell: (wall s, CPU s, what it showed)."""
    from ipyparallel import util

    from infini_notebook.core.output import StreamLabeler
    from infini_notebook.kernel import gc_pace
    from infini_notebook.kernel.cell import Cell
    from infini_notebook.kernel.output_files import OutputFiles
    from infini_notebook.kernel.printers import TextPrinter
    from infini_notebook.launch import reply_dates

    down, up = socks
    parse_date = reply_dates.make_parser(util)
    shown, said = io.StringIO(), io.StringIO()
    c0, t0 = time.process_time(), time.perf_counter()
    with contextlib.redirect_stdout(shown), contextlib.redirect_stderr(said), gc_pace.paced(n):
        ar, ranks = _Cell(n, count), list(range(n))
        files = OutputFiles(f"{folder}/cell{count}", ranks, f"In[{count}]")
        cell = Cell(ar, ranks, StreamLabeler(), TextPrinter(echo=True, owns_cell=True), files)
        code = "print(f'hello from {rank}')" if printing else ""
        for h in range(hosts):  # the cell once per host
            body = {"host": h, "count": count, "code": code, "print": printing}
            down.send(signing.sign(key, "cell", json.dumps(body)))

        failed = []

        def receive():
            try:
                for _ in range(hosts):
                    if not up.poll(30_000):
                        raise TimeoutError("no packed reply from the relays in 30 s")
                    _unpack(key, up.recv(), ar, parse_date)
            except BaseException as e:  # the cell's thread raises it
                failed.append(e)
                cell.changed.set()

        io_thread = threading.Thread(target=receive)
        io_thread.start()
        pending = list(cell.futures.values())
        while pending and not failed:  # as CellWatch.follow shows output while the cell runs
            cell.changed.wait(0.05)
            cell.changed.clear()
            cell.show(final=False)
            pending = [f for f in pending if not f.done()]
        io_thread.join()
        if failed:
            raise failed[0]
        cell.wait_for_trailing_output()
        cell.show(final=True)
        cell.render_final()
        for r in cell.targets:  # as execution.collect reads each rank
            cell.metadata(r), cell.tail(r, "stdout"), cell.futures[r].result()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    final = "".join(
        f"[rank {i.ranks[0]}] {i.payload}\n"
        for i in cell.transcript.render(False)
        if i.kind == "stdout"
    )
    return wall, cpu, shown.getvalue() + "\0" + final + "\0" + said.getvalue()


def one_size(n: int, hosts: int, cells: int) -> dict:
    import zmq

    key = signing.new_key()
    ctx = zmq.Context()
    down, up = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    ports = [str(s.bind_to_random_port("tcp://127.0.0.1")) for s in (down, up)]
    relays = subprocess.Popen([sys.executable, "-c", RELAYS, key, str(n), str(hosts), *ports])
    folder = tempfile.mkdtemp(prefix="inb-relay-floor-")
    try:
        figures = {}
        for name, printing, check in (
            ("floor", False, lambda out: check_empty_cell(out)),
            ("floor_print", True, lambda out: check_print_cell(out, n)),
        ):
            walls, cpus = [], []
            for count in range(cells + 1):  # the first warms up
                if relays.poll() is not None:
                    raise RuntimeError(f"the relays' process ended (code {relays.returncode})")
                wall, cpu, out = one_cell((down, up), key, n, hosts, count, printing, folder)
                check(out)
                if count:
                    walls.append(wall)
                    cpus.append(cpu)
            figures[f"{name}_wall_ms"] = round(1e3 * statistics.median(walls), 1)
            figures[f"{name}_cpu_ms"] = round(1e3 * statistics.median(cpus), 1)
        return figures
    finally:
        try:
            down.send(b"end", zmq.NOBLOCK)
            relays.wait(30)
        except (zmq.Again, subprocess.TimeoutExpired):
            relays.kill()  # ours: started above
            relays.wait()
        ctx.destroy(linger=0)
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=positive, nargs="+", default=[256, 1024])
    p.add_argument("--hosts", type=positive, default=16)
    p.add_argument("--cells", type=positive, default=20)
    a = p.parse_args()
    results = {}
    for n in a.ranks:
        results[str(n)] = r = one_size(n, min(a.hosts, n), a.cells)
        print(f"{n:5d} ranks, {min(a.hosts, n)} hosts: "
              + ", ".join(f"{k} {v}" for k, v in r.items()), flush=True)  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__":
    main()
