"""The kernel's side of a session at 256 and 1,024 ranks, by simulation (issue 54).

    .venv/bin/python benchmarks/bench_scale.py [--ranks 256 1024] [--hosts 16] [--cells 20]
        [--gc-default] [--stock-dates] [--relay]

Real here: ipyparallel's controller (started as a session starts it: this package's
controller command and heartbeat settings), the session's ``launch.client.Client``, the
cell's fan-out (``DirectView.execute``, as kernel/execution.py sends a cell), the cell's
output handling (``kernel/cell.Cell`` with ``StreamLabeler`` and ``TextPrinter``: labels,
rank order, the final render), the kernel's TCPStore (hosted by launch/store_host.host, as
a session's is), and ``%dist_status``'s work (each
rank's telemetry read from the store and verified, its tiles rendered). Simulated: the
ranks, ``--hosts`` processes of benchmarks/sim_host.py, each serving N/hosts engine
identities over ipyparallel's real engine protocol, each identity with its own store
client doing a rank's bootstrap and telemetry (every 1 s, as TELEMETRY_INTERVAL_S). Left
out: torch on the ranks; the cell's supervision (kernel/watch.py's liveness and store
polls, which look at local processes this simulation does not have); each rank's output
file (kernel/output_files.py), ``execution.collect``, and the notebook's replay of the
final output (``TextPrinter`` replays only inside a kernel).

Per size: ``start_s`` (the hosts spawned to every identity registered with the client),
``bootstrap_s`` (every identity's store key and count in), ``cell_wall_ms`` and
``kernel_cpu_ms_per_cell`` (an empty cell: this process's CPU, every thread, per cell;
checked: nothing shown; ``kernel_gc_ms_per_cell``: how much of it the cyclic garbage
collector took), ``controller_cpu_ms_per_cell`` (the controller's and its
schedulers' CPU per empty cell: other processes on the kernel's machine),
``print_cell_wall_ms`` / ``print_kernel_cpu_ms`` (every rank prints one line; checked:
each rank's own line, labeled, once, in rank order, stderr empty), the same empty cell through
ipyparallel's BroadcastView with coalesced replies (``bcast_*``: the tree fan-out
measured as an alternative), ``status_ms`` (telemetry of every rank read and verified,
tiles rendered; checked: every rank's snapshot found), ``store_get_ms_p50``/``p99``
(the kernel's reads while N clients write telemetry), ``stop_s``. Medians over
``--cells``. The last line is one JSON object keyed by size.

``--relay``: cells go as a ``--relay`` session sends them (docs/scale.md): each simulated
host has a real relay process (engine/host_relay.py) and its identities take cells from it
as ranks do; the kernel's side is the session's own ``launch/relay.RelayLink`` and
``Cell``. ``relay_cpu_ms_per_cell`` is the relays' CPU per empty cell, all hosts together
(in a real session it is spent on the ranks' hosts, not the kernel's).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import itertools
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PACE_GC = True  # the collector paced as execution.run paces it (--gc-default: not)
STOCK_DATES = False  # --stock-dates: replies' dates through dateutil (launch/reply_dates.py)
RELAY = False  # --relay: cells through a relay per simulated host


def start_controller(profile_dir: str):
    """A controller as a session starts one (its command and heartbeat), and our Client."""
    import ipyparallel as ipp

    from infini_notebook.launch.client import Client
    from infini_notebook.launch.launchers import CONTROLLER_CMD, HEARTBEAT

    cluster = ipp.Cluster(
        n=0, profile_dir=profile_dir, controller_ip="127.0.0.1", controller_args=list(HEARTBEAT)
    )
    client = Client()
    client.in_loop(cluster.start_controller(controller_cmd=[sys.executable, *CONTROLLER_CMD]))
    client.attach(profile_dir, cluster.cluster_id)  # the session's own client of it
    if STOCK_DATES:  # back to ipyparallel's own, which attach replaced
        from ipyparallel import util

        from infini_notebook.launch import reply_dates

        util._parse_date = reply_dates.stock(util)
    return cluster, client


def engine_json(cluster) -> str:
    """The engines' connection file: written before ``Client.attach`` could connect."""
    return cluster.controller.connection_files["engine"]


def spawn_hosts(path: str, n: int, hosts: int, store: str, mac_key: str, link=None):
    """The simulated hosts; with ``link`` (a RelayLink), each with its relay, started here."""
    per = [n // hosts + (1 if i < n % hosts else 0) for i in range(hosts)]
    env = dict(os.environ, SIM_MAC_KEY=mac_key)
    relays = {}
    for i, k in enumerate(per):
        if k and link is not None:  # started as on another host: its own folder, stdin
            link.add_hosts([(f"h{i}", [], lambda args: [sys.executable, *args], f"host {i}")])
            relays[i] = ["--relay", *link.addresses(tag=f"h{i}")]
    return [
        subprocess.Popen(
            [
                sys.executable,
                os.path.join(HERE, "sim_host.py"),
                path,
                "--engines",
                str(k),
                "--host-index",
                str(i),
                "--store",
                store,
                *relays.get(i, []),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for i, k in enumerate(per)
        if k
    ]


def wait_registered(client, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(client.ids()) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(client.ids())} of {n} engines registered")
        client.wait_for_registration(0.5)


def run_cell(client, targets: list[int], code: str, link=None) -> tuple[float, float, str]:
    """One cell as kernel/execution.run sends and shows it (through ``link``'s relays when
    given): wall s, this process's CPU s, what it printed."""
    from infini_notebook.kernel import gc_pace

    shown, said = io.StringIO(), io.StringIO()
    pace = gc_pace.paced(len(targets)) if PACE_GC else contextlib.nullcontext()
    c0, t0 = time.process_time(), time.perf_counter()
    # paced around the cell's whole frame, as execution.run paces _follow
    with contextlib.redirect_stdout(shown), contextlib.redirect_stderr(said), pace:
        final, checks_cpu, checks_wall = _follow_cell(client, targets, code, link)
    wall = time.perf_counter() - t0 - checks_wall
    cpu = time.process_time() - c0 - checks_cpu
    return wall, cpu, shown.getvalue() + "\0" + final + "\0" + said.getvalue()


def _follow_cell(client, targets: list[int], code: str, link) -> tuple[str, float, float]:
    """``run_cell``'s cell, sent and followed to its end; then the oracles' reading of it
    (what the notebook's output shows at the end), whose CPU and wall time it returns to be
    left out of the cell's."""
    from infini_notebook.core.output import StreamLabeler
    from infini_notebook.kernel.cell import Cell
    from infini_notebook.kernel.printers import TextPrinter

    printer = TextPrinter(echo=True, owns_cell=True)
    if link is None:
        view = client.view(targets)
        cell = client.on_io_thread(
            lambda _: Cell(
                view.execute(code, silent=False, block=False), targets, StreamLabeler(), printer
            )
        )
    else:  # as kernel/execution._send_cell sends a --relay cell
        cell = Cell(link.prepare(code, "", targets), targets, StreamLabeler(), printer)
        link.send(cell.ar)
    pending = set(targets)
    while pending:  # what CellWatch.follow does for output, without its liveness checks
        cell.changed.wait(0.05)
        cell.changed.clear()
        cell.show(final=False)
        pending -= cell.finished_among(pending)
    cell.wait_for_trailing_output()
    cell.show(final=True)
    cell.render_final()
    client.forget(cell.ar.msg_ids)
    if link is not None:
        link.forget(cell.ar)
    c1, t1 = time.process_time(), time.perf_counter()
    for r, f in cell.futures.items():
        if isinstance(f.result(), BaseException):
            raise RuntimeError(f"rank {r} failed: {f.result()}")
    # what the notebook's output shows at the end (TextPrinter replays it in a kernel)
    final = "".join(
        f"[rank {i.ranks[0]}] {i.payload}\n"
        for i in cell.transcript.render(False)
        if i.kind == "stdout"
    )
    return final, time.process_time() - c1, time.perf_counter() - t1


def run_broadcast(client, targets: list[int], code: str) -> tuple[float, float]:
    """The same cell through ipyparallel's tree: one request to the broadcast scheduler,
    one coalesced reply; each rank's ``status: idle`` still comes on its own."""
    c0, t0 = time.process_time(), time.perf_counter()
    with client.lock:
        ar = client.ipp_client.broadcast_view(targets, is_coalescing=True).execute(
            code, silent=False, block=False
        )
    ar.get(timeout=120)
    ar.wait_for_output(timeout=120)
    client.forget(ar.msg_ids)
    return time.perf_counter() - t0, time.process_time() - c0


def check_print_cell(out: str, n: int) -> None:
    """The oracle for the print cell: rank r's own line, labeled [rank r], once, as it came
    (live, in arrival order), and the final output in rank order."""
    live, final, err = out.split("\0")
    if err:
        raise AssertionError(f"print cell: stderr is not empty: {err[:200]!r}")
    want = [f"[rank {r}] hello from {r}" for r in range(n)]
    for what, lines in (
        ("live", sorted(live.splitlines(), key=_rank_of)),
        ("final", final.splitlines()),
    ):
        if lines != want:
            wrong = next(pair for pair in itertools.zip_longest(lines, want) if pair[0] != pair[1])
            raise AssertionError(f"print cell, {what}: {len(lines)} lines, first wrong: {wrong}")


def check_empty_cell(out: str) -> None:
    """The oracle for an empty cell: nothing shown, on either stream."""
    if out.replace("\0", ""):
        raise AssertionError(f"empty cell showed {out[:200]!r}")


def _rank_of(line: str) -> int:
    return int(line.split("]")[0].split()[-1]) if line.startswith("[rank ") else -1


def status_once(store, mac_key: str, n: int) -> float:
    """%dist_status's work per rank: its telemetry read (rank_services.peek) and verified,
    then every tile rendered."""
    from infini_notebook.core import signing
    from infini_notebook.core.state import RankState
    from infini_notebook.engine import rank_services
    from infini_notebook.viz.status_render import status_html

    t0 = time.perf_counter()
    rows = []
    for r in range(n):
        key = rank_services.telemetry_key(r)
        raw = rank_services.peek(store, key)
        body = signing.verify(mac_key, key, raw) if raw is not None else None
        if body is None:
            raise AssertionError(f"rank {r}: no verified telemetry")
        snap = rank_services.parse_telemetry(body)
        rows.append(RankState(r, 0, f"sim{r % 16}", "cpu", "", "idle", **snap))
    html = status_html(rows)
    if html.count("data-rank=") != n:
        raise AssertionError("status: not one tile per rank")
    return time.perf_counter() - t0


def relay_cpu_s(link) -> float:
    """CPU seconds the relays have used (0 without --relay): each relay's process and the
    child it serves from (engine/host_relay.py's remote mode forks one)."""
    import psutil

    total = 0.0
    for pid in link.pids() if link is not None else []:
        with contextlib.suppress(psutil.Error):
            parent = psutil.Process(pid)
            for p in [parent, *parent.children(recursive=True)]:
                times = p.cpu_times()
                total += times.user + times.system
    return total


class CollectorTime:
    """The cyclic garbage collector's CPU in this process while ``counting``: each
    collection timed on the thread that ran it (``gc.callbacks``)."""

    def __init__(self):
        self.spent, self.counting, self._began = 0.0, False, {}

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        now = time.thread_time()
        if phase == "start":
            self._began[threading.get_ident()] = now
        elif self.counting:
            self.spent += now - self._began.pop(threading.get_ident(), now)


def controller_cpu_s(cluster) -> float:
    """CPU seconds of the controller and its schedulers so far: another process on the
    kernel's machine, which ``process_time`` does not see."""
    import psutil

    try:
        proc = psutil.Process(cluster.controller.process.pid)
        procs = [proc, *proc.children(recursive=True)]
    except (AttributeError, psutil.Error):
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def one_size(n: int, hosts: int, cells: int) -> dict:
    from infini_notebook.engine import rank_services
    from infini_notebook.launch import store_host

    profile = tempfile.mkdtemp(prefix="inb-scale-")
    mac_key = secrets.token_hex(32)
    store, port = store_host.host("127.0.0.1", 0)  # hosted as the session's store is
    cluster, client = start_controller(profile)
    procs, stopped, link = [], False, None
    try:
        path = engine_json(cluster)
        if RELAY:
            from infini_notebook.core import signing
            from infini_notebook.launch.relay import RelayLink

            link = RelayLink(profile, signing.new_key(), client)
        t0 = time.perf_counter()
        procs = spawn_hosts(path, n, hosts, f"127.0.0.1:{port}", mac_key, link)
        wait_registered(client, n)
        start_s = time.perf_counter() - t0
        deadline = time.monotonic() + 300
        while store.add("sim/joined", 0) < n:
            assert time.monotonic() < deadline, "the simulated ranks' bootstrap never ended"
            time.sleep(0.01)
        bootstrap_s = time.perf_counter() - t0 - start_s
        store.set("sim/ready", "1")
        targets = sorted(client.ids())
        for _ in range(3):  # warm: the first cells pay for connections and caches
            run_cell(client, targets, "pass", link)
        empty, ctl0, relay0 = [], controller_cpu_s(cluster), relay_cpu_s(link)
        batches0 = link.batches if link is not None else 0
        with CollectorTime() as collector:
            for _ in range(cells):
                collector.counting = True
                wall, cpu, out = run_cell(client, targets, "pass", link)
                collector.counting = False
                check_empty_cell(out)
                empty.append((wall, cpu))
        controller_ms = (controller_cpu_s(cluster) - ctl0) / cells * 1000
        relay_ms = (relay_cpu_s(link) - relay0) / cells * 1000
        batches = (link.batches - batches0) / cells if link is not None else 0
        printed = []
        for _ in range(max(3, cells // 4)):
            wall, cpu, out = run_cell(client, targets, "print('hello from', rank)", link)
            check_print_cell(out, n)
            printed.append((wall, cpu))
        # the tree fan-out, an alternative to the relay measured once (not with --relay)
        bcast = [run_broadcast(client, targets, "pass") for _ in range(0 if RELAY else cells)]
        store.wait([rank_services.telemetry_key(r) for r in range(n)])  # every rank reported
        status = [status_once(store, mac_key, n) for _ in range(5)]
        gets = []
        for i in range(200):
            g0 = time.perf_counter()
            rank_services.peek(store, rank_services.telemetry_key(i % n))
            gets.append(time.perf_counter() - g0)
        gets.sort()
        t0 = time.perf_counter()
        for p in procs:  # what Engines.stop_all does to local engines: ended, waited for
            p.terminate()
        for p in procs:
            p.wait(60)
        if link is not None:
            link.stop()
        client.stop_controller(profile)
        stop_s, stopped = time.perf_counter() - t0, True
    finally:  # also on an error or SIGTERM (main turns it into SystemExit)
        if link is not None:
            link.stop()  # its relays: pids it started
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if not stopped:
            client.stop_controller(profile)
        client.stop_loop()
        shutil.rmtree(profile, ignore_errors=True)
    med = lambda xs, i: statistics.median(x[i] for x in xs) * 1000  # noqa: E731
    return {
        "start_s": round(start_s, 2),
        "bootstrap_s": round(bootstrap_s, 2),
        "cell_wall_ms": round(med(empty, 0), 1),
        "kernel_cpu_ms_per_cell": round(med(empty, 1), 1),
        "kernel_gc_ms_per_cell": round(collector.spent / cells * 1000, 1),
        "controller_cpu_ms_per_cell": round(controller_ms, 1),
        "relay_cpu_ms_per_cell": round(relay_ms, 1),
        "relay_batches_per_cell": round(batches, 1),
        "print_cell_wall_ms": round(med(printed, 0), 1),
        "print_kernel_cpu_ms": round(med(printed, 1), 1),
        "bcast_cell_wall_ms": round(med(bcast, 0), 1) if bcast else None,
        "bcast_kernel_cpu_ms": round(med(bcast, 1), 1) if bcast else None,
        "status_ms": round(statistics.median(status) * 1000, 1),
        "store_get_ms_p50": round(gets[len(gets) // 2] * 1000, 3),
        "store_get_ms_p99": round(gets[int(len(gets) * 0.99)] * 1000, 3),
        "stop_s": round(stop_s, 2),
    }


def growth(results: dict) -> dict:
    """How each figure grows from the smallest size to the largest, against the ranks."""
    sizes = sorted(results, key=int)
    if len(sizes) < 2:
        return {}
    a, b = results[sizes[0]], results[sizes[-1]]
    noise = ("store_get_ms_p50", "store_get_ms_p99")  # flat by design: not a growth
    return {k: round(b[k] / a[k], 2) for k in a if a[k] and k not in noise}


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: give 1 or more")
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=positive, nargs="+", default=[256, 1024])
    p.add_argument("--hosts", type=positive, default=16)
    p.add_argument("--cells", type=positive, default=20)
    p.add_argument("--gc-default", action="store_true", help="cells without gc_pace")
    p.add_argument("--stock-dates", action="store_true", help="reply dates through dateutil")
    p.add_argument("--relay", action="store_true", help="cells through a relay per host")
    a = p.parse_args()
    global PACE_GC, STOCK_DATES, RELAY
    PACE_GC, STOCK_DATES, RELAY = not a.gc_default, a.stock_dates, a.relay
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks still run
    results = {}
    for n in a.ranks:
        results[str(n)] = r = one_size(n, min(a.hosts, n), a.cells)
        print(
            f"{n:5d} ranks on {min(a.hosts, n)} simulated hosts: "
            + ", ".join(f"{k} {v}" for k, v in r.items()),
            flush=True,
        )
    if len(results) > 1:
        sizes = sorted(results, key=int)
        print(f"growth {sizes[0]} -> {sizes[-1]} ranks (x{int(sizes[-1]) // int(sizes[0])}): "
              + ", ".join(f"{k} x{v}" for k, v in growth(results).items()))  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__":
    main()
