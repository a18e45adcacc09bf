"""%dist_export: a notebook's %%dist cells as a torchrun script.

The pure part (infini_notebook/export.py) is checked in milliseconds with the magics' real
flag parsers; the end-to-end test executes tutorial 06 in a real kernel, exports it, runs the
script with torchrun on 4 CPU ranks and compares what every rank printed.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import re
import subprocess
import sys
from collections import defaultdict

import nbformat
import pytest
import torch
from conftest import REPO, text_of
from IPython.core.magic_arguments import parse_argstring
from other_user import needs_root
from test_notebooks import _runner, assert_shows_committed

from infini_notebook.core import export
from infini_notebook.core.errors import DistUsageError
from infini_notebook.core.plan_checks import make_plan
from infini_notebook.core.ranks import parse_ranks
from infini_notebook.debug_magics import DebugMagics
from infini_notebook.engine.torchrun import LabeledStream, torchrun_namespace, use_gpus
from infini_notebook.groups import ParallelLayout
from infini_notebook.magics import DistMagics

H = export.HistoryCell
SETTINGS = export.Settings(ParallelLayout(4, tp=2), "gloo", 30.0)


def parse_dist(line: str):
    return parse_argstring(DistMagics.dist, line)


def parse_profile(line: str):
    return parse_argstring(DebugMagics.dist_profile, line)


def script(*cells: H, settings=SETTINGS, profile=False) -> export.Export:
    return export.export_script(
        list(cells), settings, parse_dist, "out.py", parse_profile_line=parse_profile,
        profile=profile,
    )  # fmt: skip


def cell_block(text: str, number: int) -> str:
    """The script's block for In[number], up to the next block."""
    start = text.index(f"# %% In[{number}]")
    ends = [text.find(m, start) for m in ("\n\n# ", "\n\ndist.destroy_process_group()")]
    return text[start : min(e for e in ends if e > 0)]


# --------------------------------------------------------------------------- pure: ms


def test_ranks_and_where_become_guards():
    out = script(
        H(1, "%%dist\na = 1"),
        H(2, "%%dist --ranks 0,2\nb = 2\nfor i in range(2):\n    b += i"),
        H(3, "%%dist -r 3\nc = 3"),
        H(4, "%%dist --where tp=1,dp=0 --collapse\nd = 4"),
        H(5, "%%dist --ranks all\ne = 5"),
    )
    text = out.text
    assert cell_block(text, 1).splitlines()[1] == "a = 1"
    assert "if rank in (0, 2):\n    b = 2\n    for i in range(2):\n        b += i" in text
    assert "if rank == 3:\n    c = 3" in text
    assert 'if groups.coords["tp"] == 1 and groups.coords["dp"] == 0:\n    d = 4' in text
    assert cell_block(text, 5).splitlines()[1] == "e = 5"
    assert out.cells == [1, 2, 3, 4, 5] and out.skipped == []
    compile(text, "out.py", "exec")


def test_guard_keeps_multiline_strings_and_runs_like_the_cell():
    body = 's = """line one\nline two"""\nprint(s)'
    text = script(H(1, f"%%dist --ranks 1\n{body}")).text
    assert 'if rank == 1:\n    s = """line one\nline two"""\n    print(s)' in text
    printed = io.StringIO()
    ns = {"rank": 1, "print": lambda *a: printed.write(" ".join(map(str, a)))}
    exec(cell_block(text, 1), ns)  # the guarded cell prints exactly what the cell printed
    assert printed.getvalue() == "line one\nline two"


def test_failed_cells_are_left_out_as_comments_and_listed():
    out = script(
        H(1, "%%dist\nx = 1", ok=True),
        H(2, "%%dist --ranks 0\nx = boom()", ok=False),
        H(3, "%%dist\ny = x + 1", ok=None),  # outcome unknown: kept
    )
    assert out.cells == [1, 3]
    block = cell_block(out.text, 2)
    assert "# x = boom()" in block and "\nx = boom()" not in out.text
    assert out.skipped == ["In[2]: %%dist --ranks 0 (failed in the notebook; left out, "
                           "its code below as comments)"]  # fmt: skip


def test_kernel_side_steps_are_listed_not_dropped_silently():
    out = script(
        H(1, "%load_ext infini_notebook"),
        H(2, "%%dist\nx = torch.ones(2)"),
        H(3, "%dist_pull x\nprint(x[0])"),
        H(4, "%dist_push lr"),
        H(5, "%dist_status"),
        H(6, "%%time\nsum(range(10))"),
        H(7, "%dist_export out.py"),
    )
    skipped = "\n".join(out.skipped)
    assert "In[3]: %dist_pull x" in skipped and "In[3]: notebook code" in skipped
    assert "In[4]: %dist_push lr" in skipped and "In[5]: %dist_status" in skipped
    assert "In[6]: %%time cell" in skipped
    assert "In[1]" not in skipped and "In[7]" not in skipped  # setup, replaced by the header
    for line in out.skipped:  # each one is marked where it happened in the script too
        assert f"# skipped {line}" in out.text
    assert '"# skipped" comments' in out.text.split('"""')[1]


def test_ipython_only_lines_are_commented_and_listed():
    out = script(H(1, "%%dist\nx = 1\n%timeit x + 1\n!nvidia-smi\ny = x != 2"))
    block = cell_block(out.text, 1)
    assert "# skipped (IPython only): %timeit x + 1" in block
    assert "# skipped (IPython only): !nvidia-smi" in block
    assert "y = x != 2" in block
    assert len(out.skipped) == 2
    compile(out.text, "out.py", "exec")


def test_last_expression_is_shown_as_in_the_notebook():
    out = script(
        H(1, "%%dist\nx = 2\nx * rank  # value"),
        H(2, "%%dist\nx;"),
        H(3, "%%dist --ranks 0\nx"),
    )
    assert "show(x * rank)  # value" in cell_block(out.text, 1)
    assert "show(" not in cell_block(out.text, 2)  # ';' hides the value in IPython too
    assert "if rank == 0:\n    show(x)" in out.text
    printed = io.StringIO()
    ns = {"print": lambda *a: printed.write(" ".join(a) + "\n")}
    exec(out.text.split("def show", 1)[1].split("\n\n\n")[0].join(["def show", ""]), ns)
    ns["show"](None), ns["show"]([1, 2])
    assert printed.getvalue() == "[1, 2]\n"  # None is not shown, as in IPython


def test_invalid_python_is_left_out_with_the_reason():
    out = script(H(1, "%%dist\nx = 1"), H(2, "%%dist\nfiles = !ls"))
    assert out.cells == [1]
    assert "# files = !ls" in cell_block(out.text, 2)
    assert "not plain Python" in out.skipped[-1]


def test_nothing_to_export_says_what_to_do():
    with pytest.raises(DistUsageError, match="No %%dist cell ran"):
        script(H(1, "x = 1"))
    with pytest.raises(DistUsageError, match="None of the 2 %%dist cells"):
        script(H(1, "%%dist\na()", ok=False), H(2, "%%dist\nb()", ok=False))


def test_last_session_starts_after_the_last_working_dist_start():
    history = [
        H(1, "%dist_start --nprocs 2"),
        H(2, "%%dist\nold = 1"),
        H(3, "%dist_stop"),
        H(4, "%load_ext infini_notebook\n%dist_start --nprocs 4 --tp 2 --timeout 60"),
        H(5, "%%dist\nnew = 1"),
        H(6, "%dist_start --nprocs 8", ok=False),  # refused: a session runs
    ]
    cells, line = export.last_session(history)
    assert [c.number for c in cells] == [5, 6] and line == "--nprocs 4 --tp 2 --timeout 60"
    settings = export.settings_from_start(parse_argstring(DistMagics.dist_start, line))
    assert settings == export.Settings(ParallelLayout(4, tp=2), "gloo", 60.0)
    assert export.last_session(history[1:3]) == (history[1:3], None)


def test_settings_from_start_lines():
    def settings(line):
        return export.settings_from_start(parse_argstring(DistMagics.dist_start, line))

    gpu = settings("--gpus 8 --tp 2 --pp 2 --order tp-cp-pp-dp --zero1 2")
    assert gpu.backend == "nccl" and gpu.layout == ParallelLayout(
        8, tp=2, pp=2, order="tp-cp-pp-dp", zero1=2
    )
    assert settings("--launcher ssh --hosts a:2,b:2").layout.world_size == 4
    with pytest.raises(DistUsageError, match="bad layout"):
        settings("--nprocs 4 --tp 3")


def test_header_names_the_layout_and_the_command():
    out = script(H(1, "%%dist\npass"), settings=export.Settings(
        ParallelLayout(8, tp=2, pp=2, order="tp-cp-pp-dp"), "nccl", 120.0))  # fmt: skip
    assert "torchrun --nproc_per_node 8 out.py" in out.text
    assert 'ParallelLayout(world_size=8, tp=2, cp=1, pp=2, dp=2, order="tp-cp-pp-dp")' in out.text
    assert 'backend="nccl"' in out.text and "timeout=120.0" in out.text
    assert out.summary("x/out.py").splitlines()[:2] == [
        "Wrote x/out.py: 1 %%dist cell (In[1]).",
        "Run it with: torchrun --nproc_per_node 8 x/out.py",
    ]


PROFILED = H(2, "%%dist_profile --ranks 0,1 --out prof\nseen.append(rank)\nrank * 2")


def test_a_profiled_cell_exports_as_the_cell_it_profiled():
    """%%dist_profile ran its code on the ranks: the script runs it there too, under the
    same guard, as plain code (a note says how to get the profiler back)."""
    out = script(H(1, "%%dist\nseen = []"), PROFILED, H(3, "%%dist\nprint(seen)"))
    assert out.cells == [1, 2, 3] and out.skipped == [] and not out.profiled
    block = cell_block(out.text, 2)
    assert block.splitlines()[:2] == [
        "# %% In[2]: %%dist_profile --ranks 0,1 --out prof",
        "# (profiled in the notebook; %dist_export --profile runs it so here)",
    ]
    assert "import profiled" not in out.text and "with profiled" not in out.text
    for rank, ran in ((0, [0]), (1, [1]), (2, [])):  # the guard: ranks 0 and 1 only
        shown = []
        ns = {"rank": rank, "seen": [], "show": shown.append}
        exec(block, ns)
        assert ns["seen"] == ran and shown == [2 * r for r in ran]


def test_with_profile_the_cell_runs_under_the_profiler_inside_its_guard():
    out = script(H(1, "%%dist\nseen = []"), PROFILED, profile=True)
    assert out.profiled and out.cells == [1, 2]
    block = cell_block(out.text, 2)
    folder = "dist_profile/out-In2"  # the script's name and the cell's number
    assert f"each rank's trace in {folder}/" in block
    assert f'if rank in (0, 1):\n    with profiled("{folder}", device):\n' in block
    assert "from infini_notebook.engine.torchrun import profiled, torchrun_namespace" in out.text
    compile(out.text, "out.py", "exec")
    for rank, ran in ((1, [1]), (3, [])):
        calls, seen = [], []

        @contextlib.contextmanager
        def profiled(where, device, calls=calls, seen=seen):
            calls.append((where, device, list(seen)))
            yield
            calls.append("stopped")

        ns = {"rank": rank, "seen": seen, "show": print, "profiled": profiled, "device": "cpu"}
        exec(block, ns)
        # the profiler starts before the code and stops after it, on the cell's ranks only
        assert ns["seen"] == ran
        assert calls == ([(folder, "cpu", []), "stopped"] if ran else [])


class _Session:  # what pick_settings reads of a running session
    def __init__(self, plan):
        self.plan, self.layout = plan, ParallelLayout(plan.world_size)


@pytest.mark.parametrize(
    "flags, visible, expected",
    [
        # --gpus 4,5,6,7: rank r sees GPUs 4-7 and uses its r-th, as torchrun would
        ("4,5,6,7", [str(i) for i in range(8)], [("4,5,6,7", r) for r in range(4)]),
        # --gpus 0,0: both ranks on GPU 0, which each sees once, as cuda:0
        ("0,0", [str(i) for i in range(8)], [("0", 0), ("0", 0)]),
        # ids count the kernel's visible GPUs (CUDA_VISIBLE_DEVICES=2,3,6,7): 1,3 is 3 and 7
        ("1,3", ["2", "3", "6", "7"], [("3,7", 0), ("3,7", 1)]),
        ("3,3,1,1", [str(i) for i in range(8)], [("3,1", 0), ("3,1", 0), ("3,1", 1), ("3,1", 1)]),
    ],
)
def test_the_script_puts_each_rank_on_the_gpu_it_had_in_the_session(flags, visible, expected):
    """The exported text carries the session's --gpus, and the script's ranks (through
    use_gpus, what torchrun_namespace calls before CUDA starts) see the same
    CUDA_VISIBLE_DEVICES and get the same device index as the session's ranks did."""
    plan = make_plan(gpus=flags, visible_gpus=visible, nccl_version=(2, 28, 9))
    assert [plan.cuda_devices(r) for r in range(plan.world_size)] == expected
    settings = export.pick_settings(_Session(plan), None, None)
    text = script(H(1, "%%dist\npass"), settings=settings).text
    assigned = [n for n in ast.parse(text).body if isinstance(n, ast.Assign)]
    gpus = next(ast.literal_eval(n.value) for n in assigned if n.targets[0].id == "GPUS")
    assert "    gpus=GPUS,\n)" in text
    n = plan.world_size
    for rank, (visible_there, index) in enumerate(expected):
        env = {"RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n)}
        assert use_gpus(gpus, "nccl", env) == index
        assert env["CUDA_VISIBLE_DEVICES"] == visible_there
        shares = len(set(plan.gpus)) < n  # NCCL told that ranks share a GPU, per slot
        assert ("NCCL_HOSTID" in env or "NCCL_MULTI_RANK_GPU_ENABLE" in env) == shares
        if "NCCL_HOSTID" in env:
            assert env["NCCL_HOSTID"].endswith(f"slot{rank % 2}")


def test_cpu_sessions_and_other_launchers_carry_no_gpus_and_two_nodes_are_refused():
    assert "GPUS" not in script(H(1, "%%dist\npass")).text  # CPU ranks
    ssh = make_plan(gpus=1, launcher="ssh", hosts="a:1,b:1", bind_address="10.0.0.1")
    assert export.pick_settings(_Session(ssh), None, None).gpus == ()  # their hosts pick
    line = parse_argstring(DistMagics.dist_start, "--gpus 4,5")
    assert export.settings_from_start(line).gpus == ("4", "5")
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}
    with pytest.raises(DistUsageError, match="run the script on one machine, or set GPUS = None"):
        use_gpus(("4", "5"), "nccl", env)


def test_labeled_stream_writes_whole_labeled_lines():
    sink = io.StringIO()
    stream = LabeledStream(sink, "[rank 3]")
    stream.write("a")
    assert sink.getvalue() == ""  # no half line yet
    stream.write("b\nc\n\nd")
    stream.finish()
    assert sink.getvalue() == "[rank 3] ab\n[rank 3] c\n[rank 3] \n[rank 3] d\n"


def test_torchrun_namespace_refuses_the_wrong_world(monkeypatch):
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(DistUsageError, match="torchrun --nproc_per_node 4"):
        torchrun_namespace({"world_size": 4, "tp": 2})
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DistUsageError, match="needs 4 ranks.*started 2"):
        torchrun_namespace({"world_size": 4, "tp": 2})


# --------------------------------------------------------------------------- real kernel


def run_torchrun(path: str, nproc: int, cwd=None) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",  # gloo pairs on loopback only
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": REPO,
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node", str(nproc), "--rdzv-endpoint", "127.0.0.1:0", path,
    ]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=cwd)


ENDS_AFTER_A_COLLECTIVE = """
import sys
sys.setswitchinterval(5.0)  # the GIL changes hands only where the rank lets it go
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from infini_notebook.engine.torchrun import torchrun_namespace

torchrun_namespace({"world_size": 4}, backend="gloo")
mesh = init_device_mesh("cpu", (4,))
for step in range(20):
    x = distribute_tensor(torch.randn(64, 64), mesh, [Shard(0)])
    same = bool(torch.allclose(x.full_tensor(), x.full_tensor()))
dist.destroy_process_group()
"""


def test_a_script_that_ends_right_after_its_collectives_exits_cleanly_under_torchrun(tmp_path):
    """gloo's worker threads free a finished all-gather's tensors after the rank has moved on;
    if the interpreter is finalizing by then, the rank aborts ("terminate called without an
    active exception") after printing everything, and torchrun says the run failed (1 run in
    20 of tutorial 07's exported script; this one, without ``let_gloo_workers_finish``,
    failed 3 of 6 runs, so two runs catch a regression 3 times in 4)."""
    path = tmp_path / "ends.py"
    path.write_text(ENDS_AFTER_A_COLLECTIVE)
    for _ in range(2):
        proc = run_torchrun(str(path), 4)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "terminate called" not in proc.stderr


LABEL = re.compile(r"^\[ranks? ([\d,\-]+)\] ?(.*)$")


def lines_by_rank(text: str, world: int) -> dict[int, list[str]]:
    """Labeled output -> each rank's lines in order; ``[ranks 0-3] x`` counts for each."""
    out = defaultdict(list)
    for line in text.splitlines():
        m = LABEL.match(line)
        assert m, f"unlabeled line {line!r}"
        for rank in parse_ranks(m.group(1), world):
            out[rank].append(m.group(2))
    return dict(out)


# Run after tutorial 06's cells, before its %dist_stop: guards, a last value, a failed cell
# and a %dist_pull, which the tutorial itself does not have.
EXTRA_CELLS = [
    "%%dist --where tp=1\nprint('tp rank 1 of', groups.ranks_in('tp'))\nrank * 10",
    "%%dist --ranks 0,3\nprint('checksum', round(out.sum().item(), 4))",
    "%%dist --ranks 1\nraise ValueError('left out: it failed')",
    "%dist_pull checks",
]


def run_tutorial(name: str, extra: list[str]) -> list[nbformat.NotebookNode]:
    """Run tutorial ``name`` with ``extra`` cells before its last (``%dist_stop``), check
    that it shows what its committed copy shows (as test_notebooks does for the others: the
    tutorial runs once in the suite), and return its code cells, run."""
    path = os.path.join(REPO, "notebooks", name)
    nb = nbformat.read(path, 4)
    *cells, stop = [c for c in nb.cells if c.cell_type == "code"]
    assert stop.source == "%dist_stop"
    nb.cells = cells + [nbformat.v4.new_code_cell(src) for src in extra] + [stop]
    runner = _runner()
    client = runner.Client(nb, timeout=300, kernel_name="python3", allow_errors=True,
                           resources={"metadata": {"path": REPO}})  # fmt: skip
    client.execute()
    assert_shows_committed(runner.static_outputs(nbformat.from_dict(nb)), path)
    return nb.cells


def profiled_cells(out: str) -> list[str]:
    """A %%dist_profile cell on ranks 0 and 1 that changes their state (an all_reduce over
    their tp group), and a cell that reads that state on every rank."""
    return [
        f"%%dist_profile --ranks 0,1 --out {out}\nprofiled = out.sum() * (rank + 1)\n"
        "dist.all_reduce(profiled, group=groups.tp)\nprint('profiled', round(profiled.item(), 4))",
        "%%dist\nprint('after the profile', round(profiled.item(), 4) if rank < 2 else None)",
    ]


@pytest.mark.notebooks
@pytest.mark.timeout(600)
def test_tutorial_06_exported_runs_under_torchrun_with_the_same_output(tmp_path):
    """Exported with --profile: the profiled cell runs on its ranks under torch.profiler
    (each writes its trace, holding the cell's all_reduce) and the next cell sees its state."""
    path = str(tmp_path / "nb06.py")
    extra = EXTRA_CELLS + profiled_cells(str(tmp_path / "in-notebook"))
    cells = run_tutorial("06_tensor_parallel_mlp.ipynb", extra + [f"%dist_export {path} --profile"])
    errors = [c.source for c in cells if any(o.output_type == "error" for o in c.outputs)]
    assert errors == [EXTRA_CELLS[2]], errors
    said = text_of(cells[-2])
    dist_cells = [c for c in cells if c.source.startswith("%%dist")]  # %%dist_profile too
    assert f"Wrote {path}: {len(dist_cells) - 1} %%dist cells" in said, said
    assert "torchrun --nproc_per_node 4" in said
    skipped = [line for line in said.splitlines() if line.startswith("skipped")]
    # two cells of kernel code, the tutorial's %dist_debugpy, the failed cell, %dist_pull
    assert len(skipped) == 5, said
    assert "%dist_debugpy --rank 1" in skipped[2]
    assert "(failed in the notebook" in skipped[3] and "%dist_pull checks" in skipped[4]

    notebook = lines_by_rank("".join(text_of(c, "stdout") for c in dist_cells), 4)
    assert notebook[1][-4:-2] == ["tp rank 1 of [0, 1]", "10"]  # the extra cells did show
    (checksum,) = [float(line.split()[1]) for line in notebook[0] if line.startswith("checksum")]
    profiled = float(notebook[0][-2].removeprefix("profiled "))
    assert abs(profiled - 3 * checksum) < 1e-3  # out.sum() x 1 + x 2 over ranks 0 and 1
    expected = [f"profiled {profiled}", f"after the profile {profiled}"]
    assert notebook[0][-2:] == notebook[1][-2:] == expected
    assert notebook[2][-1] == notebook[3][-1] == "after the profile None"
    proc = run_torchrun(path, 4, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines_by_rank(proc.stdout, 4) == notebook
    (folder,) = (tmp_path / "dist_profile").iterdir()  # dist_profile/nb06-In<N>
    assert folder.name.startswith("nb06-In") and "trace of this cell" in proc.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.json", "rank1.json"]
    for trace in folder.iterdir():
        names = {e.get("name", "") for e in json.load(open(trace))["traceEvents"]}
        assert any("allreduce" in n or "all_reduce" in n for n in names), sorted(names)[:40]


@pytest.mark.notebooks
@pytest.mark.timeout(600)
def test_tutorial_07_with_a_hard_restart_exports_to_the_same_training_under_torchrun(tmp_path):
    """Tutorial 07 trains (DDP, FSDP2), saves a DCP checkpoint, hard-restarts and resumes.
    Its script has no restart (it is one run): the checkpoint is saved and loaded back in
    the same processes, and every rank prints the same losses and checks as in the notebook."""
    path = str(tmp_path / "nb07.py")
    cells = run_tutorial("07_data_parallel_checkpoints.ipynb", [f"%dist_export {path}"])
    assert not [c.source for c in cells if any(o.output_type == "error" for o in c.outputs)]
    said = text_of(cells[-2])
    assert "%dist_restart --hard" in said and "torchrun --nproc_per_node 4" in said, said
    dist_cells = [c for c in cells if c.source.startswith("%%dist")]
    notebook = lines_by_rank("".join(text_of(c, "stdout") for c in dist_cells), 4)
    assert "losses match: True" in notebook[0] and "step 4 gradients match: True" in notebook[0]
    proc = run_torchrun(path, 4)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines_by_rank(proc.stdout, 4) == notebook


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_exported_script_runs_on_nccl_one_gpu_per_rank(tmp_path):
    n = torch.cuda.device_count()
    cell = "%%dist\nx = torch.ones(4, device=device) * (rank + 1)\ndist.all_reduce(x)\n"
    cell += "print(dist.get_backend(), x.device, x.sum().item())"
    out = script(H(1, cell), settings=export.Settings(ParallelLayout(n), "nccl", 60.0))
    path = tmp_path / "gpu.py"
    path.write_text(out.text)
    proc = run_torchrun(str(path), n)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    total = 4.0 * n * (n + 1) / 2
    assert lines_by_rank(proc.stdout, n) == {r: [f"nccl cuda:{r} {total}"] for r in range(n)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_exported_script_keeps_two_ranks_on_the_gpu_they_shared(tmp_path):
    """A --gpus 0,0 session's script: both ranks on that one GPU again (cuda:0 of a
    CUDA_VISIBLE_DEVICES naming it once), NCCL told they share it."""
    gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    cell = "%%dist\nimport os\nx = torch.ones(4, device=device) * (rank + 1)\ndist.all_reduce(x)\n"
    cell += "print(os.environ['CUDA_VISIBLE_DEVICES'], x.device, x.sum().item())"
    settings = export.Settings(ParallelLayout(2), "nccl", 60.0, (gpu, gpu))
    path = tmp_path / "shared.py"
    path.write_text(script(H(1, cell), settings=settings).text)
    proc = run_torchrun(str(path), 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines_by_rank(proc.stdout, 2) == {r: [f"{gpu} cuda:0 12.0"] for r in range(2)}


def test_export_magic_errors_and_help(kernel, tmp_path):
    existing = tmp_path / "taken.py"
    existing.write_text("keep me\n")
    cases = {
        f"%dist_export {existing}": "exists: pass --force to overwrite it",
        f"%dist_export {tmp_path}/no/such/dir/x.py": "does not exist: create it",
        f"%dist_export {tmp_path}": "is a folder: give a file name",
        f"%dist_export {tmp_path}/x.py": "No session is running and no %dist_start ran",
    }
    for line, message in cases.items():
        shown = text_of(kernel.run(line, allow_error=True))
        flat = " ".join(shown.split())  # error lines are wrapped for the notebook
        assert message in flat and "DistUsageError" in shown, shown
        assert "Traceback" not in shown, shown
    assert existing.read_text() == "keep me\n"
    # what %dist_export? shows (IPython pages it, so read the magic's docstring directly)
    doc = text_of(kernel.run('print(get_ipython().find_line_magic("dist_export").__doc__)'))
    assert "Write this session's %%dist and %%dist_profile cells" in doc and "--force" in doc


# ----- another user's link where the script goes (issue 44.5) ---------------------------------


def _link_as_other(folder: str, target: str) -> str:
    """As uid 65534: a shared folder's train.py, a link to where they can read it later."""
    os.makedirs(os.path.dirname(target), 0o777)
    os.symlink(target, os.path.join(folder, "train.py"))
    return "linked"


@pytest.fixture
def shared_folder():
    """A folder every user may write in (a team's scratch folder), and another user's
    folder to read from; both removed after."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="shared-", dir="/tmp")
    os.chmod(folder, 0o777)
    theirs = f"{folder}-theirs"
    yield folder, os.path.join(theirs, "loot.py")
    shutil.rmtree(folder)
    shutil.rmtree(theirs, ignore_errors=True)


@needs_root
def test_export_writes_nothing_through_another_users_link(kernel, shared_folder):
    from other_user import as_other

    folder, target = shared_folder
    assert as_other(_link_as_other, folder, target) == "linked"
    path = os.path.join(folder, "train.py")
    for flags in ("", " --force"):
        shown = text_of(kernel.run(f"%dist_export {path}{flags}", allow_error=True))
        assert "is a symbolic link" in shown and "DistUsageError" in shown, shown
    assert not os.path.exists(target)  # the link points at nothing still


@needs_root
def test_a_link_made_after_the_check_is_not_followed(shared_folder):
    """The check and the write are two steps: a link made between them is not written
    through, with --force or without."""
    from other_user import as_other

    folder, target = shared_folder
    path = os.path.join(folder, "train.py")
    export.check_path(path, force=False)  # nothing there yet
    assert as_other(_link_as_other, folder, target) == "linked"
    for force in (False, True):
        with pytest.raises(DistUsageError, match="Cannot write"):
            export.write_script(path, "print('secret')\n", force)
    assert not os.path.exists(target)
    os.remove(path)
    export.write_script(path, "print(1)\n")
    assert open(path).read() == "print(1)\n"
    with pytest.raises(DistUsageError, match="File exists"):
        export.write_script(path, "print(2)\n")  # made after the check: not overwritten
    export.write_script(path, "print(3)\n", force=True)
    assert open(path).read() == "print(3)\n"


def test_a_replaced_rank_leaves_the_script_as_it_was():
    """Issue 51: %dist_restart --ranks changes nothing the script runs: its ranks start
    once; the line is noted where it happened, for what it was."""
    cells = [H(1, "%%dist\nw = torch.ones(2)"), H(3, "%%dist\nprint(w.sum())")]
    plain = script(*cells)
    replaced = script(cells[0], H(2, "%dist_restart --ranks 2"), cells[1])
    note = (
        "In[2]: %dist_restart --ranks 2 (replaced a rank that died; the script's ranks start once)"
    )
    assert replaced.skipped == [note], replaced.skipped
    header = 'Left out (1): see the "# skipped" comments.'
    lines = [ln for ln in replaced.text.splitlines() if ln not in (f"# skipped {note}", header)]
    assert [ln for ln in lines if ln] == [ln for ln in plain.text.splitlines() if ln]
