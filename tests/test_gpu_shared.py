"""Several NCCL ranks on one GPU (``--gpus 0,0,0,0``, issue 41): the multi-rank NCCL paths a
one-GPU machine can now run. Four ranks share GPU 0 with a tp 2 x dp 2 layout, so one
session covers the world (4 ranks) and 2-rank communicators (tp and dp, split from the
world). Marked ``gpu``: skips without CUDA, as in CI. What can be checked without a GPU (the
environment each rank gets, the refusals, the labels) is in tests/test_devices.py.

``INFINI_SHARED_FLAGS`` replaces the start flags, to dry-run this module's logic on CPU
ranks (``--nprocs 4 --tp 2 --timeout 60``); the NCCL-only assertions then skip."""

from __future__ import annotations

import ast
import os
import shutil
import time

import pytest
import torch
from conftest import Frontend, text_of, use_session

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
FLAGS = os.environ.get(
    "INFINI_SHARED_FLAGS", "--gpus 0,0,0,0 --tp 2 --timeout 60 --gpu-memory-fraction 0.2"
)
ON_GPU = "--gpus" in FLAGS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ON_GPU and N_GPUS < 1, reason="needs CUDA"),
    pytest.mark.timeout(300),
]


@pytest.fixture
def four(kernel):
    use_session(kernel, FLAGS, timeout=300)
    return kernel


def said(out: str, key: str) -> dict[int, str]:
    """``{rank: rest}`` of the lines ``[rank N] KEY rest``."""
    found = {}
    for line in out.splitlines():
        label, _, rest = line.partition("] ")
        if label.startswith("[rank ") and rest.startswith(key + " "):
            found[int(label[6:])] = rest[len(key) + 1 :]
    return found


REDUCE = """%%dist
import os
x = torch.full((1 << 16,), float(rank + 1), device=device)
dist.all_reduce(x)
t = torch.full((4,), float(rank + 1), device=device)
dist.all_reduce(t, group=groups.tp)
d = torch.full((4,), float(rank + 1), device=device)
dist.all_reduce(d, group=groups.dp)
gpu = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else "cpu"
print("FACTS", dict(world=x[0].item(), tp=t[0].item(), dp=d[0].item(), device=str(device),
      gpu=gpu, hostid=os.environ.get("NCCL_HOSTID"), how=groups.how.get("tp")))
"""


def test_ranks_sharing_one_gpu_reduce_over_the_world_and_two_rank_groups(four):
    out = text_of(four.run(REDUCE, timeout=180))
    facts = {r: ast.literal_eval(v) for r, v in said(out, "FACTS").items()}
    status = text_of(four.run("%dist_status"))
    print(out, status, sep="\n")  # the record (pytest -rP)
    assert sorted(facts) == [0, 1, 2, 3], out
    assert {f["world"] for f in facts.values()} == {10.0}  # 1+2+3+4: every rank took part
    assert [facts[r]["tp"] for r in range(4)] == [3.0, 3.0, 7.0, 7.0]  # tp groups 0-1, 2-3
    assert [facts[r]["dp"] for r in range(4)] == [4.0, 6.0, 4.0, 6.0]  # dp groups 0,2 / 1,3
    assert len({f["gpu"] for f in facts.values()}) == 1  # one physical GPU for all four
    if ON_GPU:
        assert {f["device"] for f in facts.values()} == {"cuda:0"}
        assert len({f["hostid"] for f in facts.values()}) == 4  # NCCL sees four "hosts"
        assert "GPU 0: ranks 0-3, shared: correctness, not speed" in status
        assert facts[0]["how"] == "split_group", facts  # tp split from the world comm


FAULTS = """%%dist
import faulthandler, os
_fh = open(f"/tmp/infini-faults-{rank}-{os.getpid()}.log", "w")
faulthandler.enable(file=_fh)
"""


def crash_reports() -> str:
    """What faulthandler wrote for ranks that crashed (FAULTS), for the test's record."""
    import glob

    found = []
    for path in sorted(glob.glob("/tmp/infini-faults-*.log")):
        with open(path) as f:
            text = f.read().strip()
        if text:
            found.append(f"--- {path}\n{text[-3000:]}")
    return "\n".join(found)


# A rank raises while the others wait in an NCCL all_reduce, three ways of waiting: the cell
# ends and waits for its device work (cell_end), an async work's wait(), a pending .item().
WAITS = {
    "cell end": "dist.all_reduce(x)\n",
    "work.wait": "w = dist.all_reduce(x, async_op=True)\nw.wait()\nx.sum().item()\n",
    "item": "dist.all_reduce(x)\nx.item()\n",
}


@pytest.mark.parametrize("how", list(WAITS))
def test_a_wait_on_a_failed_rank_is_released_and_the_next_cell_keeps_variables(four, how):
    four.run(FAULTS)  # a rank that crashes says where (the record on a GPU run)
    four.run("%%dist\nkeep = rank + 10")
    code = (
        "%%dist\nx = torch.ones(1, device=device)\nif rank == 0:\n"
        "    raise RuntimeError('rank 0 bails out')\n" + WAITS[how]
    )
    t0 = time.perf_counter()
    cell = four.run(code, allow_error=True, timeout=200)
    took = time.perf_counter() - t0
    err = "\n".join("\n".join(o.traceback) for o in cell.outputs if o.output_type == "error")
    errors = text_of(four.run("print(dict(sorted(dist_session.last.errors.items())))"))
    print(f"{how}: released in {took:.1f} s", err, errors, sep="\n", flush=True)
    again = "%%dist\ny = torch.ones(1, device=device)\ndist.all_reduce(y)\n"
    cell = four.run(again + "print('AFTER', y.item(), keep)", timeout=180, allow_error=True)
    after = text_of(cell)
    print(after, crash_reports(), sep="\n")
    assert took < 5 + 10, took  # the 5 s, plus the kernel's round trips
    assert "rank 0 bails out" in err and "released" in err, err
    assert "died" not in err  # the released ranks raised; their processes live on
    failed = ast.literal_eval(errors.strip())
    assert sorted(failed) == [0, 1, 2, 3], errors
    if ON_GPU:  # gloo's closed connection raises its own error in the wait
        assert all("RankReleased" in failed[r] for r in (1, 2, 3)), errors
    assert said(after, "AFTER") == {r: f"4.0 {10 + r}" for r in range(4)}, after


RECORDER = """%%dist
import json, time
from infini_notebook.engine import wait_probe
x = torch.ones(1, device=device)
dist.all_reduce(x, group=groups.tp)  # the tp communicator is up: the next call only enqueues
torch.cuda.synchronize()
if rank == 1:
    time.sleep(4)  # rank 0's all_reduce on their tp group waits for this
dist.all_reduce(x, group=groups.tp)
if rank == 0:
    time.sleep(1)
    print("PENDING", wait_probe._pending_in_flight_recorder())
    print("DUMP", json.dumps(wait_probe.flight_recorder_dump())[:3000])
if device.type == "cuda":
    torch.cuda.synchronize()
print("DONE", x.item())
"""


@pytest.mark.skipif(not ON_GPU, reason="NCCL's Flight Recorder pends while the GPU waits")
def test_the_flight_recorder_names_a_two_rank_collective_pending_for_a_late_peer(four):
    out = text_of(four.run(RECORDER, timeout=120))
    print(out)
    pending = ast.literal_eval(said(out, "PENDING")[0])
    assert pending["op"] == "all_reduce" and pending["ranks"] == [0, 1], pending
    assert said(out, "DONE") == {r: "4.0" for r in range(4)}, out


LISTENING = """\
import psutil, socket
_ports = set()
for _rs in dist_session.status():
    for _c in psutil.Process(_rs.pid).net_connections("tcp"):
        if _c.status == psutil.CONN_LISTEN:
            _ports.add(_c.laddr.ip)
print(sorted(_ports))
"""


def test_the_ranks_listen_on_loopback_only(four):
    four.run(REDUCE, timeout=180)  # communicators are up and listening
    addresses = ast.literal_eval(text_of(four.run(LISTENING)).strip())
    print(addresses)
    assert addresses and set(addresses) <= {"127.0.0.1", "::1"}, addresses


def test_dist_diff_compares_device_checksums_across_ranks_sharing_a_gpu(four):
    four.run("%%dist\nw = torch.arange(4096, device=device, dtype=torch.float32)")
    same = text_of(four.run("%dist_diff w"))
    four.run("%%dist\nif rank == 2:\n    w[7] += 1")
    drift = text_of(four.run("%dist_diff w"))
    print(same, drift, sep="\n")
    assert "identical" in same and "differ" not in same, same
    assert "identical" not in drift and "2" in drift, drift


def test_profile_of_ranks_sharing_a_gpu_records_nccl_kernels(four, tmp_path):
    """Issue 39: on NCCL the communication is the GPU's NCCL kernels; a run before the fix
    showed 0.0 ms of communication on every rank. ``INFINI_GPU_RECORD``: a folder to keep
    the traces in (the device run's $OUT), as the record of a real NCCL trace."""
    profiled = (
        "x = torch.randn(1024, 1024, device=device)\n"
        "for _ in range(20):\n    dist.all_reduce(x)\n"
        "if device.type == 'cuda':\n    torch.cuda.synchronize()\n"
    )
    code = (
        f"_p = dist_session.profile({profiled!r}, out={str(tmp_path)!r}, echo=False)\n"
        "print(_p.ranks.to_string())\n"
        "print('COMM', [round(v, 3) for v in _p.ranks['communication_ms']])"
    )
    out = text_of(four.run(code, timeout=240))
    print(out)
    keep = os.environ.get("INFINI_GPU_RECORD")
    if keep:
        shutil.copytree(tmp_path, os.path.join(keep, "profile_nccl"), dirs_exist_ok=True)
    merged = (tmp_path / "merged.json").read_text()
    if ON_GPU:
        assert "ncclDevKernel" in merged or "ncclKernel" in merged, "no NCCL kernel events"
        comm = ast.literal_eval(out.split("COMM ", 1)[1].splitlines()[0])
        assert len(comm) == 4 and min(comm) > 0, comm


def test_input_on_a_gpu_rank_is_answered_from_the_notebook(four):
    ui = Frontend(four, ["alice"])
    code = "%%dist --ranks 0\nname = input('name? ')\n"
    code += "print('got', name, torch.ones(1, device=device).sum().item())"
    assert ui.run(code) == "ok"
    assert ui.prompts() == ["[rank 0] name?"]  # JupyterLab puts its own space after it
    assert "[rank 0] got alice 1.0" in ui.shown["stdout"], ui.shown


@pytest.mark.skipif(not ON_GPU, reason="a CUDA memory cap")
def test_a_rank_cannot_take_more_than_its_memory_fraction(four):
    """--gpu-memory-fraction 0.2: a rank asking for 30 % of the GPU fails alone, in one
    line, and its peers on the same GPU go on."""
    share = "int(torch.cuda.mem_get_info(device)[1] * 0.3)"
    grab = f"%%dist --ranks 0\nbig = torch.empty({share}, dtype=torch.uint8, device=device)"
    cell = four.run(grab, allow_error=True, timeout=120)
    err = "\n".join("\n".join(o.traceback) for o in cell.outputs if o.output_type == "error")
    small = "ok = torch.empty(1 << 28, dtype=torch.uint8, device=device)\nprint('fine', ok.numel())"
    out = text_of(four.run("%%dist --ranks 1\n" + small))
    print(err, out, sep="\n")
    assert "OutOfMemoryError" in err or "out of memory" in err, err
    assert "[rank 1] fine 268435456" in out, out


def test_a_rank_whose_gpu_context_a_device_side_assert_broke_is_replaced_alone(four):
    """Issue 51: a device-side assert leaves rank 1's CUDA context unusable (its process
    lives on); `%dist_restart --ranks 1` ends it and starts a new rank 1 on the same GPU,
    the survivors' NCCL communicators aborted and made anew, their variables kept; then
    `%dist_heal` gives it its dp replica's tensor and work goes on."""
    four.run("%%dist\nkeep = torch.full((4,), float(rank), device=device)")
    bad = four.run(
        "%%dist\nif rank == 1:\n    i = torch.tensor([7], device=device)\n"
        "    torch.zeros(2, device=device)[i].sum().item()",
        allow_error=True,
    )
    if ON_GPU:
        assert "device-side assert" in text_of(bad) or "CUDA error" in text_of(bad), text_of(bad)
    else:  # CPU ranks: an IndexError stands for it
        assert "index 7 is out of bounds" in text_of(bad), text_of(bad)
    out = text_of(four.run("%dist_restart --ranks 1", timeout=240))
    assert "rank 1 replaced, the others kept their variables" in out, out
    after = text_of(
        four.run(
            "%%dist\nx = torch.ones(4, device=device); dist.all_reduce(x)\n"
            "print('AFTER', x[0].item(), 'keep' in dir() and keep[0].item())"
        )
    )
    assert said(after, "AFTER") == {0: "4.0 0.0", 1: "4.0 False", 2: "4.0 2.0", 3: "4.0 3.0"}
    healed = text_of(four.run("%dist_heal keep --from dp"))  # from rank 3, its dp replica
    assert "healed keep (Tensor) over dp from rank 3 to rank 1" in healed, healed
    on = text_of(four.run("%%dist\nkeep += 1\nprint('ON', keep.sum().item(), keep.device)"))
    values = {r: v.split()[0] for r, v in said(on, "ON").items()}
    assert values == {0: "4.0", 1: "16.0", 2: "12.0", 3: "16.0"}, on  # it goes on from there


def test_relayed_cells_reach_nccl_ranks_sharing_a_gpu_and_a_release_still_works(kernel):
    """Issue 54's relay (``--relay``) on GPU ranks: the same NCCL answers as through
    ipyparallel, every rank's line labeled, and a wait on a failed rank released with
    ``RankReleased`` through the relayed cell. Last in the module: it starts its own session."""
    use_session(kernel, FLAGS + " --relay", timeout=300)
    out = text_of(kernel.run(REDUCE, timeout=180))
    facts = {r: ast.literal_eval(v) for r, v in said(out, "FACTS").items()}
    assert [facts[r]["world"] for r in range(4)] == [10.0] * 4, out
    assert [facts[r]["tp"] for r in range(4)] == [3.0, 3.0, 7.0, 7.0], out
    batches = "print(dist_session.engines.relay.batches)"  # the relay carried the cell
    assert int(text_of(kernel.run(batches))) > 0
    kernel.run("%%dist\nkeep = rank + 10")
    code = (
        "%%dist\nx = torch.ones(1, device=device)\nif rank == 0:\n    raise RuntimeError('bails')\n"
    )
    cell = kernel.run(code + WAITS["item"], allow_error=True, timeout=200)
    err = "\n".join("\n".join(o.traceback) for o in cell.outputs if o.output_type == "error")
    failed = ast.literal_eval(
        text_of(kernel.run("print(dict(sorted(dist_session.last.errors.items())))")).strip()
    )
    print("relay release:", err, failed, sep="\n")
    assert "bails" in err and "released" in err, err
    assert sorted(failed) == [0, 1, 2, 3], failed
    if ON_GPU:
        assert all("RankReleased" in failed[r] for r in (1, 2, 3)), failed
    again = "%%dist\ny = torch.ones(1, device=device)\ndist.all_reduce(y)\n"
    after = text_of(kernel.run(again + "print('AFTER', y.item(), keep)", timeout=180))
    assert said(after, "AFTER") == {r: f"4.0 {10 + r}" for r in range(4)}, after
