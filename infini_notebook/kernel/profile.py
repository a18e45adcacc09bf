"""``%%dist_profile``: the cell run as ``%%dist`` runs it, under torch.profiler on each
rank; then the ranks' traces merged into one timeline (core/timeline.py) and written to one
folder: ``merged.json`` (Chrome/Perfetto, a track per rank on one clock) and each rank's
own trace (``rankN.json``, with the distributed info HTA reads)."""

from __future__ import annotations

import functools
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from ..core import rank_trace, timeline, trace_merge
from ..core.errors import DistCellError, DistUsageError
from ..core.ranks import rank_label
from ..engine import profiling
from . import execution, private_files, supervision

CLOCK_SAMPLES = 5
DEFAULT_MAX_MB = 200.0


@dataclass
class ProfileResult:
    """What ``session.profile`` returns: the verdict (who made the others wait, and how
    long), per-rank and per-collective DataFrames (full precision; shown rounded), the
    figure, the files, and the ranks whose cell failed (their traces are partial)."""

    ranks: Any  # DataFrame: wall, compute, wait, communication, idle (ms), ops, top ops
    collectives: Any  # DataFrame: per collective, who arrived last and the wait it caused
    folder: str
    merged: str
    files: dict[int, str] = field(default_factory=dict)
    partial: list[int] = field(default_factory=list)
    size_bytes: int = 0
    coverage: str = ""  # what the wait figures do not cover, in words
    verdict: str = ""  # "rank 2 arrived last in 3 of 3 all_reduces; the other ranks ..."
    straggler: tuple[int, int, int] | None = None  # (rank, arrived last at, of): the figure

    @functools.cached_property
    def figure(self):
        """The per-rank figure, drawn when first asked for (a draw costs 0.3-0.5 s)."""
        from ..viz.profile_plots import plot_breakdown

        return plot_breakdown(self.ranks, self.straggler)

    def summary(self, wrapped: bool = True) -> str:
        """Where the files are (and what the figures do not cover), wrapped between words
        (JupyterLab would break a long line anywhere)."""
        from ..viz.profile_render import files_line, wrap
        from ..viz.render import format_bytes

        part = (
            f"; partial (the cell failed) on {rank_label(self.partial)[1:-1]}"
            if self.partial
            else ""
        )
        covers = f"\nNote: {self.coverage}." if self.coverage else ""
        text = files_line(len(self.files), format_bytes(self.size_bytes), self.folder, part)
        return wrap(text + covers) if wrapped else text + covers

    def _repr_mimebundle_(self, **kwargs) -> dict:
        from ..viz import figure_bundle
        from ..viz.profile_render import profile_html, profile_text

        bundle = figure_bundle(self.figure)
        shown = (self.verdict, self.ranks, self.collectives)
        bundle["text/html"] = profile_html(*shown, bundle["text/html"], self.summary(wrapped=False))
        bundle["text/plain"] = profile_text(*shown, self.summary())
        return bundle


def profile(s, code: str, targets: list[int], printer, out: str | None, max_mb: float, name: str):
    """Run ``code`` on ``targets`` under the profiler; returns a ProfileResult, and raises
    the cell's DistCellError after writing what the others recorded."""
    import pandas as pd

    s.require_whole()
    _start(s, targets)
    failure: DistCellError | None = None
    try:  # from here on the profilers run: the finally stops them, whatever happens
        clocks = {r: _clock(s, r) for r in targets}
        execution.run(s, code, targets, False, None, printer)
    except DistCellError as e:
        failure = e
    finally:  # a failed cell too: the others' traces are worth having (not from a rank
        # that died, or one stuck in its cell: the stop would queue behind it)
        gone = set(supervision.dead_ranks(s, targets)) | s.book.stuck()
        alive = [r for r in targets if r not in gone]
        got = s.apply_each(
            {r: (profiling.stop, (int(max_mb * 2**20), r)) for r in alive}, "profile stop"
        )
    too_big = {r: g["too_big"] for r, g in got.items() if "too_big" in g}
    if too_big:
        _stop_all(s, [r for r, g in got.items() if "summary" in g])  # their parsed traces
        sizes = ", ".join(f"{rank_label([r])[1:-1]} {b / 2**20:.0f} MB" for r, b in too_big.items())
        raise DistUsageError(
            f"The traces are over the {max_mb:g} MB limit ({sizes}): profile fewer steps, or "
            "raise it with --max-mb."
        )
    traces = [
        rank_trace.RankTrace(
            r,
            [],
            {},
            [],
            clocks[r],
            fr_lost=g["fr_lost"],
            group_ranks=g["group_ranks"],
            given=g["summary"],
        )
        for r, g in sorted(got.items())
        if "summary" in g
    ]
    timeline.align(traces)
    cell = re.sub(r"\W", "", name or "") or "cell"  # In4, not In[4]: no quoting in a shell
    folder = out or os.path.join("dist_profile", f"{cell}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        folder = private_files.make_folder(folder, fresh=out is None)  # 0700, no link followed
    except BaseException:  # the ranks keep their parsed traces for ``write``: drop them
        _stop_all(s, [t.rank for t in traces])
        raise
    # each rank moves and writes its own events while the kernel makes the tables
    zero, bases = trace_merge.zero_us(traces), trace_merge.flow_bases(traces)
    here = os.path.abspath(folder)
    written = s.submit_each(
        {
            t.rank: (
                profiling.write,
                (
                    t.rank,
                    here if s.engines.local(t.rank) else None,
                    t.shift_us - zero,
                    bases[t.rank],
                ),
            )
            for t in traces
        },
        "profile write",
    )
    try:
        try:
            rows = timeline.rank_rows(traces)
            ranks = pd.DataFrame(rows)
            collectives = pd.DataFrame(timeline.collective_rows(traces))
            coverage = timeline.coverage(traces, rows)
            verdict = timeline.verdict(traces)
        finally:  # the ranks' writes end before anything else happens, whatever happened
            answers = written()
        hosts = {rs.rank: rs.host for rs in s.book.rows}
        files, merged = _write_files(folder, traces, hosts, answers, zero)
    finally:  # the fragments are in merged.json, or of no use
        for t in traces:
            try:
                os.remove(os.path.join(folder, profiling.fragment_name(t.rank)))
            except OSError:
                pass
    result = ProfileResult(
        ranks=ranks,
        collectives=collectives,
        folder=folder,
        merged=merged,
        files=files,
        partial=sorted(failure.ranks) if failure else [],
        size_bytes=sum(g.get("size", 0) for g in got.values()),
        coverage=coverage,
        verdict=verdict.text,
        straggler=(verdict.rank, verdict.last, verdict.of) if verdict.rank is not None else None,
    )
    if failure is not None:
        printer.out(f"{result.summary()}\n")  # where the traces are, above the error
        failure.profile = result  # the API's caller finds them on the error
        raise failure
    return result


def _start(s, targets: list[int]) -> None:
    """Start every rank's profiler, or none: on any rank that could not (or that already
    runs a torch.profiler of the user's, which a second one would stop), every profiler
    started is stopped again and the profile refused in one line."""
    try:
        answers = s.apply(profiling.start, bool(s.plan.gpus), ranks=targets)
    except DistCellError as e:  # an engine could not even run the call
        _stop_all(s, targets)
        raise DistUsageError(f"%%dist_profile could not start: {e}") from None
    refused = {r: a["refused"] for r, a in answers.items() if "refused" in a}
    failed = {r: a["error"] for r, a in answers.items() if "error" in a}
    if refused or failed:
        _stop_all(s, targets)
    if refused:
        where = rank_label(sorted(refused))[1:-1]
        raise DistUsageError(
            f"%%dist_profile refused: {next(iter(refused.values()))} on {where}; stop it first "
            "(prof.stop(), or leave its with-block)."
        )
    if failed:
        r, why = next(iter(sorted(failed.items())))
        raise DistUsageError(f"%%dist_profile could not start the profiler on rank {r}: {why}")


def _stop_all(s, targets: list[int]) -> None:
    if not targets:
        return
    try:
        s.apply(profiling.stop_quietly, ranks=targets)
    except DistCellError:
        pass


def _clock(s, rank: int) -> rank_trace.RankClock:
    """The rank's wall clock against ours, from round trips through the store."""
    samples = []
    for _ in range(CLOCK_SAMPLES):
        before = time.time_ns()
        answer = s.rendezvous.ask([rank], "clock", 1.0).get(rank)
        after = time.time_ns()
        if answer is not None:
            samples.append((before, int(answer), after))
    return rank_trace.best_sample(samples) if samples else rank_trace.RankClock()


def _write_files(folder: str, traces, hosts: dict, written: dict, zero: float):
    """Each rank's own trace (written by the rank itself on this host) and the merged trace,
    streamed from the ranks' fragments; ({rank: path}, merged's path)."""
    files = {}
    for t in traces:
        got = written[t.rank]
        if "trace" in got:  # a rank on another host sent its texts
            files[t.rank] = private_files.write_text(folder, f"rank{t.rank}.json", got["trace"])
        else:
            files[t.rank] = os.path.join(folder, f"rank{t.rank}.json")

    def fragments(rank: int):
        got = written[rank]
        if "fragment" in got:
            yield got["fragment"]
            return
        fd = os.open(got["fragment_file"], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            while chunk := f.read(1 << 20):
                yield chunk

    merged = private_files.write(
        folder, "merged.json", lambda f: trace_merge.write(f, traces, hosts, fragments, zero)
    )
    return files, merged
