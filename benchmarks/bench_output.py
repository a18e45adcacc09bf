"""What a flood of output costs the notebook's process: ``%%dist`` against ipyparallel's
``%%px`` on the very same engines.

    .venv/bin/python benchmarks/bench_output.py [--ranks 4] [--lines 100000] [--repeats 3]

In one IPython shell, a session of ``--ranks`` CPU ranks; ``%%px_ours`` runs ``%%px`` on its
engines. Each rank prints ``--lines`` lines, then rewrites one line ``--lines`` times with
``\\r`` (a progress line). For each tool and workload: the wall time, this process's CPU
time (user + system: the client's work, not the engines') and its peak RSS above the start
(sampled every 10 ms). What the magics print goes to a sink that keeps nothing. The best of
``--repeats`` runs, interleaved so that both tools see the same machine load.
Target (issue 34): peak RSS growth under 50 MiB (``%%dist`` keeps a 1 MB tail per rank and
stream and writes the rest to a file; ``%%px`` keeps all of it, so its growth follows the
output's size). The CPU times are shown side by side: ``%%dist`` does more per message
(labels, the live progress display, the file, the rank-order render at the end).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time

import psutil

WORKLOADS = {
    "lines": "for _i in range({n}):\n    print(f'line {{_i}} of rank', flush=False)",
    "\\r updates": "for _i in range({n}):\n    print(f'\\r{{_i}}', end='')\nprint()",
}


RSS_TARGET_MIB = 50


class Sink:
    """A stdout that keeps nothing (what a notebook's front end holds is not measured)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


class PeakRss:
    """This process's highest RSS while the block runs, sampled on a thread."""

    def __init__(self):
        self.proc, self.peak, self.stop = psutil.Process(), 0, threading.Event()

    def __enter__(self):
        self.start = self.peak = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.wait(0.01):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def measure(shell, magic: str, code: str) -> dict[str, float]:
    proc = psutil.Process()
    cpu0, t0 = proc.cpu_times(), time.perf_counter()
    with PeakRss() as rss, contextlib.redirect_stdout(Sink()), contextlib.redirect_stderr(Sink()):
        shell.run_cell_magic(magic, "", code)
    cpu1 = proc.cpu_times()
    return {
        "wall": time.perf_counter() - t0,
        "cpu": (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system),
        "rss": (rss.peak - rss.start) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from IPython.testing.globalipapp import start_ipython

    import infini_notebook

    shell = start_ipython()
    shell.run_line_magic("load_ext", "infini_notebook")
    session = infini_notebook.start(nprocs=args.ranks)
    try:
        view = session.engines.client.view(slice(None))
        view.block = True
        view.activate("_ours")  # %%px_ours: %%px on the engines %%dist uses
        shell.run_cell_magic("dist", "", "pass")
        best: dict[tuple[str, str], dict[str, float]] = {}
        for _ in range(args.repeats):
            for workload, template in WORKLOADS.items():
                code = template.format(n=args.lines)
                for magic in ("dist", "px_ours"):
                    got = measure(shell, magic, code)
                    key = (workload, magic)
                    best[key] = {k: min(v, best.get(key, got)[k]) for k, v in got.items()}
    finally:
        session.stop()
    print(
        f"\n{args.ranks} ranks x {args.lines:,} lines / \\r updates each, best of "
        f"{args.repeats} (this process: CPU s, peak RSS growth MiB; wall s):"
    )
    print(f" {'workload':<12} {'tool':<8} {'CPU s':>7} {'RSS MiB':>8} {'wall s':>7}")
    for (workload, magic), m in best.items():
        tool = "%%dist" if magic == "dist" else "%%px"
        print(f" {workload:<12} {tool:<8} {m['cpu']:7.2f} {m['rss']:8.1f} {m['wall']:7.2f}")
    for workload in WORKLOADS:
        ours, px = best[(workload, "dist")], best[(workload, "px_ours")]
        verdict = "PASS" if ours["rss"] < RSS_TARGET_MIB else "FAIL"
        print(
            f" {workload}: CPU %%dist/%%px {ours['cpu'] / max(px['cpu'], 1e-9):.2f}; target "
            f"%%dist peak RSS growth < {RSS_TARGET_MIB} MiB -> {verdict}"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
