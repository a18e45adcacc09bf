"""What runs inside each engine (one process per rank): bootstrap, namespace, stack dumps,
telemetry, parent watch. The kernel calls these functions through ipyparallel's ``apply``.

Importing this module must stay cheap and torch-free: ipyparallel unpickles functions by
module reference, and the environment (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS) has to be set
before torch is first imported on the engine.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

# Per-engine state that outlives one process group: the base store is reused across soft
# restarts (each attempt gets its own PrefixStore).
_STATE: dict[str, Any] = {}


def user_namespace() -> dict:
    """The namespace ``%%dist`` cells run in (the engine's IPython shell)."""
    from IPython import get_ipython

    return get_ipython().user_ns


def bootstrap(cfg: dict) -> dict:
    """Set up this rank: environment, device, process group, parallel groups, namespace.

    ``cfg`` comes from the kernel (see ``cluster.Session._engine_config``)."""
    _set_environment(cfg)
    if cfg.get("watch", "pid") == "pid":
        _watch_parent(cfg["kernel_pid"], cfg["kernel_start"])
    else:  # the kernel is on another host: its store going away is the signal
        _watch_store(cfg["master_addr"], cfg["master_port"])
    _install_stack_dumper(cfg)
    _remember_failures()
    _keep_no_output_history()
    import torch

    torch.set_num_threads(cfg["threads"])
    _install_env_rendezvous()
    if cfg.get("cuda") is not None:
        torch.cuda.set_device(_device(torch, cfg))  # cuda:LOCAL_RANK, as torchrun code expects
    _install_telemetry(cfg)
    init_distributed(cfg)
    return describe_rank(user_namespace()["device"])


def _keep_no_output_history() -> None:
    """A cell's last value goes to the kernel (``session.last``) and nowhere else on the
    rank: IPython's output cache (Out, _, __, ___, _N) would keep every one alive, GPU
    tensors included, for as long as the engine runs."""
    from IPython import get_ipython

    shell = get_ipython()
    shell.displayhook.cache_size = 0  # what IPython does for InteractiveShell.cache_size=0
    shell.displayhook.do_full_cache = 0
    shell.events.register("post_run_cell", _drop_logged_outputs)


def _drop_logged_outputs(result=None) -> None:
    """IPython's history also logs each cell's formatted outputs and tracebacks; drop them
    after the cell."""
    from IPython import get_ipython

    history = get_ipython().history_manager
    for name in ("outputs", "output_hist_reprs", "exceptions"):
        logged = getattr(history, name, None)
        if logged is not None:
            logged.clear()


def _set_environment(cfg: dict) -> None:
    env = engine_environment(cfg)
    if cfg.get("loopback_only") and "GLOO_SOCKET_IFNAME" not in os.environ:
        iface = _loopback_interface()
        if iface:  # gloo listens where the hostname resolves, maybe a public address
            env["GLOO_SOCKET_IFNAME"] = iface
    os.environ.update(env)
    _STATE["cfg"] = cfg


def engine_environment(cfg: dict) -> dict[str, str]:
    """The variables a rank gets: torchrun's, the layout's (what ``init_parallel_groups()``
    reads) and the visible GPUs. Pure, from the kernel's ``cfg``."""
    from .groups import ParallelLayout

    env = {
        "RANK": cfg["rank"],
        "LOCAL_RANK": cfg["local_rank"],
        "WORLD_SIZE": cfg["world_size"],
        "LOCAL_WORLD_SIZE": cfg["local_world_size"],
        "GROUP_RANK": cfg["group_rank"],
        "MASTER_ADDR": cfg["master_addr"],
        "MASTER_PORT": cfg["master_port"],
        # The kernel hosts the store on MASTER_PORT, as torchrun's agent does: a user's own
        # init_process_group("env://") then connects to it instead of trying to host one there.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": cfg["attempt"],
        "OMP_NUM_THREADS": cfg["threads"],
        **ParallelLayout(**cfg["layout"]).to_env(),
    }
    if cfg.get("cuda") is not None:
        env["CUDA_VISIBLE_DEVICES"] = cfg["cuda"][0]
    return {key: str(value) for key, value in env.items()}


def _loopback_interface() -> str | None:
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addrs):
            return name
    return None


def _device(torch, cfg: dict):
    cuda = cfg.get("cuda")
    return torch.device("cuda", cuda[1]) if cuda is not None else torch.device("cpu")


def init_distributed(cfg: dict) -> None:
    """(Re)create the default process group and the parallel groups under a fresh prefix,
    then put the usual names into the user's namespace. Called again by a soft restart."""
    import torch
    import torch.distributed as dist

    from .groups import ParallelLayout

    device = _device(torch, cfg)
    timeout = timedelta(seconds=cfg["timeout"])
    store = dist.PrefixStore(f"attempt_{cfg['attempt']}", _base_store(cfg, timeout))
    dist.init_process_group(
        cfg["backend"],
        store=store,
        rank=cfg["rank"],
        world_size=cfg["world_size"],
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    ns = user_namespace()
    layout = ParallelLayout(**cfg["layout"])
    ns.update(rank_namespace(layout, device, cfg["local_rank"], timeout=timeout))
    _STATE["groups"] = ns["groups"]


def rank_namespace(layout, device, local_rank: int, timeout=None) -> dict:
    """The names a ``%%dist`` cell sees: torch, dist, rank, world_size, local_rank, device,
    groups, mesh, layout. Builds the parallel groups (collective: every rank calls it, after
    ``dist.init_process_group``). Engines and ``torchrun_namespace`` both use it."""
    import torch
    import torch.distributed as dist

    from .groups import init_parallel_groups

    groups = init_parallel_groups(layout, timeout=timeout)  # every group, not only the world
    return {
        "torch": torch,
        "dist": dist,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "local_rank": local_rank,
        "device": device,
        "groups": groups,
        "mesh": groups.mesh,
        "layout": layout,
    }


def torchrun_namespace(
    layout, *, backend: str = "auto", timeout: float = 300.0, label_output: bool = True
) -> dict:
    """Under torchrun: the same names a session's rank has (see ``rank_namespace``).

    Initialises the default group from torchrun's environment with ``backend`` and
    ``timeout`` (seconds), one GPU per local rank for nccl, then builds ``layout``'s groups.
    ``label_output`` prefixes every line this rank prints with ``[rank N]``, as the notebook
    does. Scripts written by ``%dist_export`` start with it."""
    import torch
    import torch.distributed as dist

    from .errors import DistUsageError
    from .groups import ParallelLayout

    if not isinstance(layout, ParallelLayout):
        layout = ParallelLayout.from_dict(layout)
    env = os.environ
    n = layout.world_size
    if "RANK" not in env or "LOCAL_RANK" not in env:
        raise DistUsageError(f"Run this script with torchrun: torchrun --nproc_per_node {n} FILE")
    if int(env.get("WORLD_SIZE", -1)) != n:
        raise DistUsageError(
            f"This script needs {n} ranks (its layout: {layout.describe()}), but torchrun "
            f"started {env.get('WORLD_SIZE')}: run it with torchrun --nproc_per_node {n} "
            f"(or --nnodes M --nproc_per_node N with M x N = {n})."
        )
    local_rank = int(env["LOCAL_RANK"])
    if label_output:
        label_streams(f"[rank {env['RANK']}]")
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        timeout=timedelta(seconds=timeout),
        device_id=device if device.type == "cuda" else None,
    )
    return rank_namespace(layout, device, local_rank)


class LabeledStream:
    """Wraps a text stream: each complete line goes out prefixed with ``label``, one line per
    write and flush, so lines of ranks sharing a terminal or pipe do not cut into each other."""

    def __init__(self, stream, label: str):
        self.stream, self.label, self._partial = stream, label, ""

    def write(self, text: str) -> int:
        from .output import prefix_lines

        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            self.stream.write(prefix_lines(self.label, line))
            self.stream.flush()
        return len(text)

    def finish(self) -> None:
        """Write an unfinished last line (at exit)."""
        if self._partial:
            self.write("\n")

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str):  # fileno, isatty, encoding ... of the real stream
        return getattr(self.stream, name)


def label_streams(label: str) -> None:
    """Prefix everything this process prints (stdout and stderr) with ``label``."""
    import atexit

    for name in ("stdout", "stderr"):
        stream = LabeledStream(getattr(sys, name), label)
        setattr(sys, name, stream)
        atexit.register(stream.finish)


def _install_env_rendezvous() -> None:
    """A user's own ``init_process_group("env://")`` in a cell gets fresh store keys each time.

    With TORCHELASTIC_USE_AGENT_STORE torch uses the kernel's store with bare keys, so a second
    destroy and re-init (in one cell, or after a %dist_restart) would read the first one's
    stale gloo/nccl addresses and hang. Prefixing each init by (attempt, count) keeps ranks in
    step: every rank re-inits the same number of times, and a restart starts the count over.
    torch has no public way to replace a scheme's handler, hence its registry."""
    import importlib

    from torch.distributed import PrefixStore

    rdzv = importlib.import_module("torch.distributed.rendezvous")  # the name is a function too
    torch_env = rdzv._rendezvous_handlers.get("env")
    if torch_env is None or getattr(torch_env, "_infini", False):
        return

    def env_handler(url: str, **kwargs):
        store, rank, world_size = next(torch_env(url, **kwargs))
        attempt = _STATE["cfg"]["attempt"]
        counts = _STATE.setdefault("user_inits", {})
        counts[attempt] = n = counts.get(attempt, 0) + 1
        yield PrefixStore(f"user/attempt_{attempt}/init_{n}", store), rank, world_size
        raise RuntimeError("Unable to perform re-rendezvous using env:// method")

    env_handler._infini = True
    rdzv._rendezvous_handlers["env"] = env_handler


def _base_store(cfg: dict, timeout: timedelta):
    """The store every attempt shares: a client of the kernel's TCPStore, or a FileStore."""
    import torch.distributed as dist

    if "store" in _STATE:
        return _STATE["store"]
    spec = cfg["store"]
    if spec["kind"] == "file":
        store = dist.FileStore(spec["path"], cfg["world_size"])
    else:
        # env:// reads the address from the environment, as torch's env rendezvous does.
        host = os.environ["MASTER_ADDR"] if spec["kind"] == "env" else spec["host"]
        port = int(os.environ["MASTER_PORT"]) if spec["kind"] == "env" else spec["port"]
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    _STATE["store"] = store
    return store


def teardown_distributed() -> bool:
    """Destroy the process groups (before a soft restart). Returns True when done."""
    import torch.distributed as dist

    groups = _STATE.pop("groups", None)
    if groups is not None and hasattr(groups, "destroy"):
        groups.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
    return True


def reinit_distributed(attempt: int) -> dict:
    cfg = dict(_STATE["cfg"], attempt=attempt)
    _set_environment(cfg)  # TORCHELASTIC_RESTART_COUNT follows the attempt
    teardown_distributed()
    init_distributed(cfg)
    return describe_rank(user_namespace()["device"])


def describe_rank(device=None) -> dict:
    """Static facts for the status display."""
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "device": str(device) if device is not None else "cpu",
        "device_name": "cpu",
        "memory_used": None,
    }
    if device is not None and getattr(device, "type", "") == "cuda":
        import torch

        info["device_name"] = torch.cuda.get_device_name(device)
        info["memory_used"] = torch.cuda.memory_allocated(device)
    return info


def pull_value(name: str) -> Any:
    """A namespace value for the kernel, with tensors moved to CPU."""
    ns = user_namespace()
    if name not in ns:
        raise NameError(f"name {name!r} is not defined on this rank")
    return _to_cpu(ns[name])


def _to_cpu(value: Any) -> Any:
    try:
        import torch
    except ImportError:
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def push_values(values: dict) -> None:
    user_namespace().update(values)


# Session.stacks asks rank r for its stacks by setting stack_key(r, "ask", n), n counting up
# from the store's counter stack_key(r, "count"); the rank answers under stack_key(r, "answer", n).
def stack_key(rank: int, what: str, n: int | None = None) -> str:
    return f"infini/stacks/{rank}/{what}" + ("" if n is None else f"/{n}")


def _install_stack_dumper(cfg: dict) -> None:
    """Answer Session.stacks through the kernel's TCPStore, from a thread of our own: an
    apply would queue behind a running cell, while this thread runs beside it, also while the
    cell is stuck in a collective (torch releases the GIL while it waits). The store client
    and the scratch file are this engine's, so it works on any host. The counter is read
    here, before bootstrap returns, so that no request can come before the thread listens."""
    import torch.distributed as dist

    rank = cfg["rank"]
    store = dist.TCPStore(
        cfg["master_addr"], int(cfg["master_port"]), is_master=False, timeout=timedelta(seconds=60)
    )
    answered = store.add(stack_key(rank, "count"), 0)
    scratch = tempfile.TemporaryFile()  # no name: nothing to clean up, nothing shared

    def serve(answered: int) -> None:
        while True:
            ask = stack_key(rank, "ask", answered + 1)
            try:
                store.wait([ask], timedelta(hours=1))
            except Exception:  # no request yet, or the kernel is gone (the watchers end us)
                time.sleep(1.0)
                continue
            answered += 1
            try:
                store.set(stack_key(rank, "answer", answered), _dump_stacks(scratch))
                store.delete_key(ask)
            except Exception:
                pass

    threading.Thread(target=serve, args=(answered,), name="infini-stacks", daemon=True).start()


def _dump_stacks(scratch) -> str:
    """Every thread's stack, faulthandler's format, the cell's thread as 'Current thread'."""
    scratch.seek(0)
    scratch.truncate()
    faulthandler.dump_traceback(file=scratch, all_threads=True)
    scratch.seek(0)
    dump = scratch.read().decode(errors="replace")
    return as_seen_by_thread(dump, threading.main_thread().ident, threading.get_ident())


_THREAD_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")


def as_seen_by_thread(dump: str, main: int, helper: int) -> str:
    """A faulthandler dump taken on thread ``helper``, relabeled as if taken on ``main``: the
    helper's own block goes, the main thread's becomes 'Current thread'."""
    blocks = []
    for block in dump.strip().split("\n\n"):
        m = _THREAD_HEADER.match(block.lstrip())
        ident = int(m.group(2), 16) if m else None
        if ident == helper:
            continue
        if ident == main:
            block = block.lstrip().replace(m.group(1), "Current thread", 1)
        elif m and m.group(1) == "Current thread":
            block = block.lstrip().replace("Current thread", "Thread", 1)
        blocks.append(block)
    return "\n\n".join(blocks) + "\n"


# Each rank's telemetry thread writes a JSON snapshot under telemetry_key(rank) every
# TELEMETRY_INTERVAL_S; Session.status() reads them into RankState.
TELEMETRY_INTERVAL_S = 1.0


# The snapshot's fields, named as RankState's.
TELEMETRY_FIELDS = ("rss", "cpu_percent", "memory_used", "memory_total", "gpu_util")


def telemetry_key(rank: int) -> str:
    return f"infini/telemetry/{rank}"


def parse_telemetry(raw: bytes) -> dict:
    """A snapshot as the kernel reads it: known numeric fields only, {} when unreadable."""
    try:
        snap = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(snap, dict):
        return {}
    return {
        k: v
        for k, v in snap.items()
        if k in TELEMETRY_FIELDS and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _install_telemetry(cfg: dict) -> None:
    """Publish this rank's resource use (RSS, CPU %, GPU memory and utilization) through the
    kernel's TCPStore from a thread of our own, so it stays fresh while a cell runs (also on
    another host). Its own store client: the stack thread's sits in a long wait."""
    rank = cfg["rank"]
    gpu = cfg["cuda"][1] if cfg.get("cuda") is not None else None  # device index: LOCAL_RANK

    def publish() -> None:
        import psutil
        import torch.distributed as dist

        proc = psutil.Process()
        proc.cpu_percent(None)  # the first call only starts the measurement
        store = None
        while True:
            time.sleep(TELEMETRY_INTERVAL_S)
            try:
                if store is None:
                    store = dist.TCPStore(
                        cfg["master_addr"],
                        int(cfg["master_port"]),
                        is_master=False,
                        timeout=timedelta(seconds=10),
                    )
                store.set(telemetry_key(rank), json.dumps(_snapshot(proc, gpu)))
            except Exception:  # the kernel is gone or busy: the watchers end us if it is gone
                store = None

    threading.Thread(target=publish, name="infini-telemetry", daemon=True).start()


def _snapshot(proc, gpu: int | None) -> dict:
    """This process's RSS and CPU % (100 = one core), and on a GPU rank the device's memory
    in use and total (every process on it, as nvidia-smi counts) and its utilization."""
    snap = {"rss": proc.memory_info().rss, "cpu_percent": proc.cpu_percent(None)}
    if gpu is not None:
        import torch

        free, total = torch.cuda.mem_get_info(gpu)
        snap.update(memory_used=total - free, memory_total=total)
        try:  # needs nvidia-ml-py; torch maps our CUDA_VISIBLE_DEVICES to NVML's index
            snap["gpu_util"] = torch.cuda.utilization(gpu)
        except Exception:
            pass
    return snap


def _remember_failures() -> None:
    """Keep the exception of the last cell that failed (None after one that succeeded) for
    ``post_mortem``: sys.last_traceback alone is overwritten by any failing apply, such as
    a %dist_pull of a missing name."""
    if "failure_hook" in _STATE:  # once per engine process
        return
    from IPython import get_ipython

    def after_cell(result) -> None:
        _STATE["failure"] = result.error_in_exec or result.error_before_exec

    get_ipython().events.register("post_run_cell", after_cell)
    _STATE["failure_hook"] = after_cell


def post_mortem(code: str) -> str:
    """Run ``code`` in the frame where this rank's last cell failed; its printed output
    (and the last expression's repr) come back as text."""
    from IPython import get_ipython

    error = _STATE.get("failure")
    if error is None:
        raise RuntimeError("the last cell on this rank did not fail: no frame to inspect")
    compiler = get_ipython().compile
    frame = failing_frame(error.__traceback__, lambda f: compiler.format_code_name(f) is not None)
    if frame is None:  # a SyntaxError: the cell never ran
        raise RuntimeError(f"the last cell failed before running ({type(error).__name__})")
    return run_in_frame(code, frame)


def failing_frame(tb, is_cell_file):
    """The innermost frame of the user's own cells in traceback ``tb`` (not torch's or our
    plumbing's), else the innermost frame; None for an empty traceback."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    cells = [f for f in frames if is_cell_file(f.f_code.co_filename)]
    return (cells or frames or [None])[-1]


def run_in_frame(code: str, frame) -> str:
    """Exec ``code`` over a copy of the frame's globals and locals (one namespace, so that
    comprehensions see the locals), as a REPL would: stdout and the last expression's repr
    are returned. Assignments stay in the copy."""
    import ast
    import contextlib
    import io

    tree = ast.parse(code, "<post-mortem>", "exec")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    ns = {**frame.f_globals, **frame.f_locals}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(tree, "<post-mortem>", "exec"), ns)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<post-mortem>", "eval"), ns)
            if value is not None:
                print(repr(value))
    return out.getvalue()


def identity() -> dict:
    """What the kernel needs to map this engine to a global rank (see launchers.assign_ranks)."""
    env = os.environ
    launcher_rank = next(
        (env[k] for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID") if k in env), None
    )
    return {
        "launcher_rank": launcher_rank,
        "host_index": env.get("INFINI_HOST_INDEX"),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
    }


def _watch_store(host: str, port: int) -> None:
    """Exit when the kernel's TCPStore stops answering (three misses in a row)."""

    def watch() -> None:
        import torch.distributed as dist

        misses = 0
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
        except Exception:
            os._exit(3)
        while misses < 3:
            time.sleep(1.0)
            try:
                store.check(["infini/alive"])
                misses = 0
            except Exception:
                misses += 1
        os._exit(3)

    threading.Thread(target=watch, name="infini-store-watch", daemon=True).start()


def _watch_parent(kernel_pid: int, kernel_start: float) -> None:
    """Exit when the notebook kernel is gone (even after SIGKILL): ipyparallel alone would
    leave engines running for minutes."""

    def alive() -> bool:
        try:
            import psutil

            return abs(psutil.Process(kernel_pid).create_time() - kernel_start) < 1.0
        except Exception:
            return False

    def watch() -> None:
        while alive():
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, name="infini-parent-watch", daemon=True).start()
