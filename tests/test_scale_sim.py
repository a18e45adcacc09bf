"""The scale simulator (benchmarks/sim_host.py) and its benchmark (bench_scale.py) at a small
N: simulated hosts register their identities with a real controller, the session's
client sends them cells through ``kernel/cell.Cell``, and every figure the benchmark
prints comes from runs its own oracles checked (each rank's line labeled, once, in rank
order; one verified telemetry snapshot and one tile per rank)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

pytestmark = pytest.mark.timeout(300)


def run_benchmark(name: str, ranks: int, *args: str, timeout: float) -> dict:
    """benchmarks/``name`` at ``ranks``: its figures, from the JSON its last line prints."""
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", name), "--ranks", str(ranks), *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])[str(ranks)]


def test_the_benchmark_runs_at_a_small_size_and_ends_with_its_json():
    figures = run_benchmark("bench_scale.py", 6, "--hosts", "2", "--cells", "2", timeout=240)
    for key in ("cell_wall_ms", "kernel_cpu_ms_per_cell", "start_s", "stop_s", "status_ms"):
        assert figures[key] > 0, figures
    # the kernel's CPU in a cell can never exceed two cores for its wall time
    assert figures["kernel_cpu_ms_per_cell"] <= 2 * figures["cell_wall_ms"] + 5, figures


def test_the_benchmark_through_relays_runs_its_oracles_and_ends_with_its_json():
    """bench_scale.py --relay: a real relay per simulated host, the session's RelayLink and
    Cell on the kernel's side; the oracles check every cell before a figure counts."""
    figures = run_benchmark(
        "bench_scale.py", 6, "--hosts", "2", "--cells", "2", "--relay", timeout=240
    )
    assert figures["relay_batches_per_cell"] > 0 and figures["relay_cpu_ms_per_cell"] >= 0
    assert figures["kernel_cpu_ms_per_cell"] > 0 and figures["cell_wall_ms"] > 0, figures
    assert 0 <= figures["kernel_gc_ms_per_cell"] <= figures["kernel_cpu_ms_per_cell"], figures


def test_simulated_ranks_answer_cells_errors_and_calls_as_engines_do():
    import bench_scale

    profile = tempfile.mkdtemp(prefix="inb-scale-test-")
    cluster, client = bench_scale.start_controller(profile)
    procs = []
    try:
        path = bench_scale.engine_json(cluster)
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    os.path.join(ROOT, "benchmarks", "sim_host.py"),
                    path,
                    "--engines",
                    "2",
                    "--host-index",
                    str(i),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for i in range(2)
        ]
        assert [p.stdout.readline().split() for p in procs] == [["registered", "2"]] * 2
        bench_scale.wait_registered(client, 4, timeout=60)
        targets = sorted(client.ids())
        assert targets == [0, 1, 2, 3]
        _, _, out = bench_scale.run_cell(client, targets, "print('hello from', rank)")
        bench_scale.check_print_cell(out, 4)
        with pytest.raises(RuntimeError, match="rank 2 failed.*ZeroDivisionError"):
            bench_scale.run_cell(client, targets, "x = 1 / 0 if rank == 2 else rank")
        view = client.view(targets)  # apply: a function called on each identity's host
        # (ids go in the order the identities registered: hosts interleave)
        assert sorted(view.apply_sync(os.getpid)) == sorted(p.pid for p in procs for _ in range(2))
        # the namespace a cell ran in is each rank's own (rank 2's raised before setting x)
        _, _, out = bench_scale.run_cell(client, [0, 1, 3], "print('x is', x)")
        assert out.split("\0")[1].splitlines() == [f"[rank {r}] x is {r}" for r in (0, 1, 3)]
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
        client.stop_controller(profile)
        client.stop_loop()
        shutil.rmtree(profile, ignore_errors=True)


def test_the_print_cells_oracle_catches_what_a_user_would_see_wrong():
    import bench_scale

    right = "\n".join(f"[rank {r}] hello from {r}" for r in range(3)) + "\n"
    bench_scale.check_print_cell(right + "\0" + right + "\0", 3)
    wrong = {
        "a line missing": right.replace("[rank 1] hello from 1\n", ""),
        "a line twice": right + "[rank 2] hello from 2\n",
        "another rank's value": right.replace("hello from 2", "hello from 1"),
    }
    for shown in wrong.values():
        with pytest.raises(AssertionError):
            bench_scale.check_print_cell(shown + "\0" + right + "\0", 3)
        with pytest.raises(AssertionError):
            bench_scale.check_print_cell(right + "\0" + shown + "\0", 3)
    with pytest.raises(AssertionError, match="stderr"):
        bench_scale.check_print_cell(right + "\0" + right + "\0[rank 0] warning\n", 3)
    with pytest.raises(AssertionError):
        bench_scale.check_empty_cell("\0[rank 0] x\n\0")
    bench_scale.check_empty_cell("\0\0")
