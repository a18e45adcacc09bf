"""GPU path: one rank per GPU on nccl, torchrun-style code unchanged (each rank sees its node's
GPUs and owns cuda:LOCAL_RANK). Skips cleanly where CUDA is absent (as in CI); the multi-rank
test needs 2 GPUs, since on one rank an all_reduce proves nothing."""

from __future__ import annotations

import ast
import threading
import time

import pytest
import torch
from conftest import message, text_of

from infini_notebook.engine import bootstrap as engine

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(N_GPUS < 1, reason="needs CUDA"),
]

# What torchrun code does first, then facts only a correctly pinned rank gets right.
TORCHRUN_STYLE = """%%dist
import os
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
x = torch.full((4,), float(rank + 1), device=f"cuda:{local}")
dist.all_reduce(x)
facts = dict(
    backend=str(dist.get_backend()),
    device=str(device),
    local=local,
    current=torch.cuda.current_device(),
    on=str(x.device),
    visible=os.environ["CUDA_VISIBLE_DEVICES"],
    count=torch.cuda.device_count(),
    local_world=int(os.environ["LOCAL_WORLD_SIZE"]),
    uuid=str(torch.cuda.get_device_properties(device).uuid),
    value=x[0].item(),
)
print(facts)
"""


def facts_of(out: str) -> dict[int, dict]:
    facts = {}
    for line in out.splitlines():
        if line.startswith("[rank "):
            label, _, rest = line.partition("] ")
            facts[int(label[6:])] = ast.literal_eval(rest)
    return facts


def run_torchrun_style(kernel, gpus: int) -> dict[int, dict]:
    started = text_of(kernel.run(f"%dist_start --gpus {gpus} --timeout 60", timeout=300))
    # forked from a template that never touched CUDA: each rank initialises its own
    assert "engines forked from the warm template" in started, started
    try:
        facts = facts_of(text_of(kernel.run(TORCHRUN_STYLE, timeout=120), "stdout"))
        assert "cuda" in text_of(kernel.run("%dist_status"))
    finally:
        kernel.run("%dist_stop", allow_error=True)
    assert sorted(facts) == list(range(gpus)), facts
    for rank, f in facts.items():
        assert f["backend"] == "nccl"
        # single host: LOCAL_RANK is the rank, and cuda:LOCAL_RANK is this rank's device
        assert f["local"] == rank and f["current"] == rank
        assert f["device"] == f["on"] == f"cuda:{rank}"
        assert f["count"] == f["local_world"] == gpus == len(f["visible"].split(","))
        assert f["value"] == sum(range(1, gpus + 1))
    return facts


def test_one_gpu_rank_is_pinned_to_cuda_local_rank(kernel):
    run_torchrun_style(kernel, 1)


def test_gpus_by_id_pin_the_rank_to_that_gpu_and_say_which(kernel):
    """``--gpus K,`` is GPU K (of the kernel's visible ones), where ``--gpus K`` is K GPUs:
    the last visible GPU, so that on a 2+ GPU machine it is not the one a count would pick."""
    last = N_GPUS - 1
    started = text_of(kernel.run(f"%dist_start --gpus {last}, --timeout 60", timeout=300))
    try:
        assert f"GPUs {last};" in started, started
        out = text_of(kernel.run(TORCHRUN_STYLE, timeout=120), "stdout")
        status = text_of(kernel.run("%dist_status"))
    finally:
        kernel.run("%dist_stop", allow_error=True)
    (f,) = facts_of(out).values()
    assert f["device"] == "cuda:0" and f["count"] == 1
    want = str(torch.cuda.get_device_properties(last).uuid)
    assert f["uuid"] == want  # the very GPU asked for, seen as cuda:0 by the rank
    assert f"(GPU {last})" in status


@pytest.mark.skipif(N_GPUS < 2, reason="needs 2 GPUs")
def test_two_gpu_ranks_reduce_across_distinct_gpus(kernel):
    facts = run_torchrun_style(kernel, 2)
    assert facts[0]["value"] == facts[1]["value"] == 3.0  # 1 + 2: both ranks took part
    assert facts[0]["uuid"] != facts[1]["uuid"]  # two physical GPUs, not one shared
    assert facts[0]["visible"] == facts[1]["visible"]  # same node, same list, as torchrun


def test_status_shows_live_gpu_memory_while_a_cell_holds_it():
    import infini_notebook
    from infini_notebook import viz

    session = infini_notebook.start(gpus=1, timeout=60)
    try:
        session.run("import time", echo=False)
        time.sleep(2 * engine.TELEMETRY_INTERVAL_S)
        before = session.status()[0]
        assert before.memory_total and before.memory_used is not None, before
        code = "held = torch.empty(1 << 30, dtype=torch.uint8, device=device)\ntime.sleep(6)"
        cell = threading.Thread(target=session.run, args=(code,), kwargs={"echo": False})
        cell.start()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            rs = session.status()[0]
            if rs.memory_used - before.memory_used >= 1 << 30:
                break
            time.sleep(0.2)
        running = cell.is_alive()
        cell.join(60)
        assert running and rs.memory_used - before.memory_used >= 1 << 30, (before, rs)
        assert f"of {viz._bytes(rs.memory_total)}" in viz.status_tile_html(rs)
    finally:
        session.stop()


# What one GPU can show without peers (#20 item 12): the check finds a corrupted element,
# and the first status reports the device's memory in use, as telemetry does (item 13).
CHECK_FINDS_CORRUPTION = """%%dist
from infini_notebook.engine import bench_kernels as be
buf = torch.zeros(1024, device=device)
spec = {"collective": "all_reduce"}
def corrupted():
    dist.all_reduce(buf)
    buf[17] += 1
print(be._check(torch, spec, buf, buf, lambda: dist.all_reduce(buf), 1, 0, 1024),
      be._check(torch, spec, buf, buf, corrupted, 1, 0, 1024))
"""


def test_one_gpu_check_finds_a_corrupted_element_and_status_counts_device_memory(kernel):
    kernel.run("%dist_start --gpus 1 --timeout 60", timeout=300)
    try:
        assert "[rank 0] 0 1" in text_of(kernel.run(CHECK_FINDS_CORRUPTION, timeout=120))
        # before any telemetry: the CUDA context alone is hundreds of MiB of the device's
        # memory, where allocator bytes (the old first value) would be 0
        used = text_of(kernel.run("print(dist_session.ranks[0].memory_used)")).strip()
        assert int(used) > 100 << 20, used
    finally:
        kernel.run("%dist_stop", allow_error=True)


def test_device_work_that_outlives_the_cell_keeps_the_rank_busy(kernel):
    """torch.cuda._sleep queues GPU work that runs on after the Python code returned: the
    rank is in its cell (busy) until the GPU is done, and the cell's time includes it."""
    kernel.run("%dist_start --gpus 1 --timeout 60", timeout=300)
    try:
        kernel.run("%%dist --background\ntorch.cuda._sleep(4 * 10**9)  # seconds of GPU cycles")
        time.sleep(0.5)
        states = text_of(kernel.run("print([r.state for r in dist_session.status()])"))
        kernel.run("dist_session.background.join(60)")
        elapsed = float(text_of(kernel.run("print(dist_session.last.elapsed)")))
    finally:
        kernel.run("%dist_stop", allow_error=True)
    assert states.strip() == "['busy']", states
    assert elapsed > 1.0, elapsed


@pytest.mark.skipif(N_GPUS < 2, reason="needs 2 GPUs")
def test_nccl_wait_on_a_failed_rank_is_aborted_and_the_rank_survives(kernel):
    """Issue 18 on NCCL: rank 0 raises while rank 1 waits in an all_reduce. The release
    aborts the communicators; with TORCH_NCCL_ASYNC_ERROR_HANDLING (set on the engines) the
    aborted wait raises in the cell instead of ending the process, and the groups are
    rebuilt, so the next cell works with the variables kept."""
    kernel.run("%dist_start --gpus 2 --timeout 120", timeout=300)
    try:
        kernel.run("%%dist\nkeep = rank + 10")
        t0 = time.perf_counter()
        cell = kernel.run(
            "%%dist\nx = torch.ones(1, device=device)\nif rank == 0:\n"
            "    raise RuntimeError('rank 0 bails out')\ndist.all_reduce(x)\nx.item()",
            allow_error=True,
            timeout=200,
        )
        took = time.perf_counter() - t0
        err = "\n".join("\n".join(o.traceback) for o in cell.outputs if o.output_type == "error")
        assert took < 5 + 10, took  # the 5 s, plus nbclient's share; not 120 s
        summary = message(cell)
        assert "rank 1 was waiting for rank 0 in the cell's 1st all_reduce" in summary, summary
        assert "released" in summary
        assert "died" not in err  # the aborted rank raised; its process lives on
        # the released rank raised: it never went on with the buffer NCCL left untouched
        errors = text_of(kernel.run("print(sorted(dist_session.last.errors))"))
        assert errors.strip() == "[0, 1]", errors
        out = text_of(kernel.run("%%dist\ny = torch.ones(1, device=device)\n"
                                 "dist.all_reduce(y)\nprint(y.item(), keep)"))  # fmt: skip
        assert "[rank 0] 2.0 10" in out and "[rank 1] 2.0 11" in out
    finally:
        kernel.run("%dist_stop", allow_error=True)


# The NCCL Flight Recorder is bound only in a CUDA build (c10d/init.cpp, USE_C10D_NCCL): its
# schema has never been read live. A 1-rank all_reduce queued behind GPU sleep cycles stays
# pending (NCCL's stream waits on the current one) while the host goes on.
RECORDER_READ = """%%dist
import json, time
from infini_notebook.engine import wait_probe
from infini_notebook.core import recorder
x = torch.ones(1, device=device)
torch.cuda._sleep(3 * 10**9)
dist.all_reduce(x)
dump = wait_probe.flight_recorder_dump()
print("KEYS", sorted(dump or {}))
print("PENDING", wait_probe._pending_in_flight_recorder())
torch.cuda.synchronize()
deadline = time.monotonic() + 10  # the NCCL watchdog marks completion as it polls
while (after := wait_probe._pending_in_flight_recorder()) and time.monotonic() < deadline:
    time.sleep(0.1)
print("AFTER", after)
"""


def test_the_nccl_flight_recorder_names_a_pending_collective_until_it_completes(kernel):
    kernel.run("%dist_start --gpus 1 --timeout 60", timeout=300)
    try:
        out = text_of(kernel.run(RECORDER_READ, timeout=120))
    finally:
        kernel.run("%dist_stop", allow_error=True)
    print(out)  # the record of a live NCCL dump (pytest -rP shows it)
    said = [ln.partition("] ")[2].split(" ", 1) for ln in out.splitlines() if "] " in ln]
    lines = {key: value for key, value in said}
    assert "pg_status" in lines["KEYS"], out
    pending = ast.literal_eval(lines["PENDING"])
    assert pending["op"] == "all_reduce" and pending["group"] == "world", out
    assert pending["ranks"] == [0] and pending["seq"] >= 1, out
    assert lines["AFTER"] == "None", out


# Poisoned CUDA context: every later CUDA call on the rank fails, so only a new process helps.
DEVICE_ASSERT = """%%dist
import torch.nn.functional as F
F.embedding(torch.tensor([5], device=device), torch.zeros(2, 3, device=device))
torch.cuda.synchronize()
"""


def test_a_device_side_assert_is_reported_and_a_hard_restart_recovers(kernel):
    kernel.run("%dist_start --gpus 1 --timeout 60", timeout=300)
    try:
        kernel.run("%%dist\nkeep = 7")
        bad = text_of(kernel.run(DEVICE_ASSERT, allow_error=True, timeout=120))
        after = text_of(kernel.run("%%dist\nprint(torch.ones(1, device=device).item())",
                                   allow_error=True, timeout=120))  # fmt: skip
        restart = text_of(kernel.run("%dist_restart --hard", allow_error=True, timeout=300))
        out = text_of(kernel.run("%%dist\nprint(torch.ones(2, device=device).sum().item())"))
        status = text_of(kernel.run("%dist_status"))
    finally:
        kernel.run("%dist_stop", allow_error=True)
    print(bad, after, restart, out, status, sep="\n----\n")  # what the user saw (-rP)
    assert "device-side assert" in bad or "CUDA error" in bad, bad
    assert "[rank 0] 2.0" in out, out


@pytest.mark.skipif(N_GPUS < 2, reason="needs 2 GPUs: one NCCL rank per GPU")
def test_cpu_leaves_on_an_nccl_session_are_measured_over_a_gloo_twin(kernel):
    """Adam's ``step`` stays on the CPU: measured over the world's gloo twin (built on
    first use on every rank), where the NCCL group would refuse a CPU tensor."""
    kernel.run("%dist_start --gpus 2 --timeout 60", timeout=300)
    try:
        kernel.run(
            "%%dist\nnet = torch.nn.Linear(4, 4).to(device)\n"
            "opt = torch.optim.Adam(net.parameters())\n"
            "net(torch.ones(1, 4, device=device)).sum().backward()\nopt.step()\n"
            "if rank == 1:\n    opt.state[net.weight]['step'] += 1\n"
            "    opt.state[net.bias]['exp_avg'][0] += 0.5"
        )
        kernel.run("d = %dist_diff opt --group world", timeout=120)
        rows = text_of(kernel.run("print(sorted(map(str, d.to_dict('records'))))"))
        mine = "'ranks': 'rank 1', 'compared_with': 'rank 0', 'max_abs_diff'"
        assert f"'leaf': 'state.0.step', {mine}: 1.0" in rows, rows
        assert f"'leaf': 'state.1.exp_avg', {mine}: 0.5" in rows, rows
    finally:
        kernel.run("%dist_stop", allow_error=True)


def test_profile_on_a_gpu_rank_records_its_kernels(kernel, tmp_path):
    """%%dist_profile with CUDA activity: GPU kernels count as compute on the rank's row."""
    kernel.run("%dist_start --gpus 1 --timeout 60", timeout=300)
    try:
        code = (
            "import json\n_p = dist_session.profile('x = torch.randn(2048, 2048, device=device)\\n"
            f"for _ in range(20):\\n    x = x @ x / 2048', out={str(tmp_path)!r}, echo=False)\n"
            "print(json.dumps(_p.ranks.to_dict('records')))"
        )
        rows = ast.literal_eval(text_of(kernel.run(code, timeout=180)).replace("null", "None"))
        assert rows[0]["compute_ms"] > 0, rows
        merged = (tmp_path / "merged.json").read_text()
        assert '"cat": "kernel"' in merged or '"cat":"kernel"' in merged
    finally:
        kernel.run("%dist_stop", allow_error=True)
