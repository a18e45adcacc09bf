"""Every tutorial notebook runs top to bottom in a real kernel on CPU ranks (gloo), and shows
what its committed copy shows.

Any error fails the test, except in cells tagged ``raises-exception``. Each cell's outputs are
then compared with the committed ones in notebooks/*.ipynb (see ``cell_view``: lines grouped
per rank label, timings, pids, ports and temporary paths masked), so a change in what a user
sees fails here until the notebooks are regenerated. Each notebook takes 20 to 60 s on
2 cores; deselect them with ``-m "not notebooks"``. The committed outputs are refreshed with
``scripts/notebook_sources/build.py`` (or ``scripts/run_notebooks.py --inplace``); this test
executes a copy in memory and writes nothing.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re

import nbformat
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "notebooks", "[0-9][0-9]_*.ipynb")))
# Run by test_export.py, which adds a %dist_export cell, runs the script under torchrun and
# compares the notebook with its committed copy as here (``assert_shows_committed``): each
# tutorial runs once in the suite.
EXPORTED = ("06_tensor_parallel_mlp.ipynb", "07_data_parallel_checkpoints.ipynb")

# Cells (by id) whose outputs are not fully deterministic; every other cell must match.
# shape: numbers masked (measurements, arrival order, float rounding across CPUs);
# stdout: stderr ignored (a traceback through torch's internals, which vary by version);
# skip: nothing compared (pandas tables of measurements wrap by the widths of the numbers,
# faulthandler stacks list torch's frames).
MODES = {
    **dict.fromkeys(["03-09", "03-13", "03-19", "03-23", "03-25"], "shape"),
    **dict.fromkeys(["03-11", "03-15", "03-17", "03-21", "03-27", "03-30"], "skip"),
    **dict.fromkeys(["04-08", "04-13", "04-17", "04-20", "04-31"], "shape"),
    # 05: background and stopped cells print stacks and tracebacks through torch on stderr;
    # which ranks time out first in a mismatch, or lose their connection to a dead rank
    # before they are released, varies from run to run
    **dict.fromkeys(["05-27", "05-40"], "stdout"),
    **dict.fromkeys(["05-20", "05-30", "05-44"], "skip"),
    **dict.fromkeys(["06-05", "06-09"], "shape"),
    # the live memory tiles (RSS or device memory) and a stage's timings
    **dict.fromkeys(["07-09", "07-14", "07-23", "07-26"], "shape"),
    "08-22": "shape",
    # 10: the profile's figure and tables are measurements; the diff's largest difference
    "10-06": "skip",
    "10-13": "shape",
    # 11: the kept sessions' table: when it started, its memory, its time left
    "11-07": "skip",
    # 12: which ranks were seen waiting for the dead rank, and which lost their connection
    "12-07": "skip",
}

ANSI = re.compile(r"\x1b\[[0-9;]*m")
LABEL = re.compile(r"^(\[ranks? [^\]]+\])( |$)")
MASKS = [  # (pattern, replacement), applied in order to every line compared
    # first: a checkout under /tmp (a CI clone) would be cut by the TMP mask below
    (re.compile(r'("(localRoot|remoteRoot)": )"[^"]*"'), r'\1"FOLDER"'),
    (re.compile(r"/tmp/\S+"), "TMP"),
    (re.compile(r"0x[0-9a-f]+"), "HEX"),
    (re.compile(r"[0-9a-f]{20,}"), "HASH"),
    (re.compile(r"(PORT=|127\.0\.0\.1:)\d+"), r"\1PORT"),
    # %dist_debugpy's attach configuration: the kernel's bridge port (its folders: above)
    (re.compile(r'("port": )\d+'), r"\1PORT"),
    (re.compile(r"\d+(\.\d+)? ?(s|ms|us|µs)\b"), "TIME"),
    (re.compile(r"\b\d\d:\d\d:\d\d\b"), "CLOCK"),  # a time of day (the attach line's)
    (re.compile(r"\(\d+ % of"), "(PCT % of"),  # a profile's share of the cell: measured too
    # live usage in status tables (RSS and CPU %, or GPU memory and utilization) varies
    (re.compile(r"\s*·\s*(RSS \S+ \S+|CPU \d+%|[\d.]+ \S+ of [\d.]+ \S+|util \d+%)"), ""),
    (re.compile(r"\b(RSS [\d.]+ ?\w+|CPU \d+%)"), "USAGE"),  # the same as printed values
    # threads per rank follow the machine's CPUs (the ready line)
    (re.compile(r"\d+(/\d+)* threads? per rank"), "THREADS per rank"),
    # spare engines are forked once the session has been idle a second: there or not yet
    (re.compile(r"\s*·\s*\d+ spare engines for the next hard restart"), ""),
    # status tables: 'rank state coords host pid device'; host and pid vary by machine
    (re.compile(r"\S+\s+\d+\s+(cpu|cuda:\d+)(\s+\(.*\))?$"), r"HOST PID \1\2"),  # (its note)
    (re.compile(r"\s+"), " "),  # column widths follow the masked values
]
NUMBER = re.compile(r"-?\d+(\.\d+)?(e[+-]?\d+)?")


def mask(line: str, mode: str = "exact") -> str:
    for pattern, repl in MASKS:
        line = pattern.sub(repl, line)
    if mode == "shape":
        line = NUMBER.sub("N", line)
    return line.strip()


def label_ranks(label: str) -> list[str]:
    """'[rank 5]' -> ['5']; '[ranks 0,2-3]' -> ['0', '2', '3']."""
    ranks = []
    for part in label.strip("[]").split(" ", 1)[1].split(","):
        first, _, last = part.partition("-")
        ranks += [str(r) for r in range(int(first), int(last or first) + 1)]
    return ranks


def stream_view(text: str, mode: str) -> dict[str, list[str]]:
    """A stream's lines per rank, each rank's in order: ranks print at the same time, so
    lines of different ranks interleave differently from run to run, and --collapse merges
    the ranks whose lines arrive close together (a '[ranks 0-1]' line counts for both)."""
    groups: dict[str, list[str]] = {}
    for line in ANSI.sub("", text).splitlines():
        m = LABEL.match(line)
        labels, rest = (label_ranks(m.group(1)), line[m.end() :]) if m else ([""], line)
        for label in labels:
            groups.setdefault(label, []).append(mask(rest, mode))
    return groups


def cell_view(cell, mode: str = "exact") -> dict:
    """What a reader sees of one code cell's outputs, in a form that two runs share."""
    if mode == "skip":
        return {}
    streams: dict[str, str] = {}
    errors, displays = [], []
    for out in cell.outputs:
        if out.output_type == "stream":
            if not (mode == "stdout" and out.name == "stderr"):
                streams[out.name] = streams.get(out.name, "") + out.text
        elif out.output_type == "error":
            first = ANSI.sub("", out.evalue).split("\n")[0]
            errors.append((out.ename, mask(first, mode)))
        else:
            data = out.get("data", {})
            text = ANSI.sub("", data.get("text/plain", ""))
            if text.startswith(("waiting ", "waited ")):  # only on a machine slow enough
                continue
            displays.append((sorted(data), [mask(x, mode) for x in text.splitlines()]))
    return {
        "streams": {name: stream_view(text, mode) for name, text in streams.items()},
        "errors": errors,
        "displays": displays,
    }


def test_cell_view_groups_interleaved_ranks_and_masks_what_varies():
    out = nbformat.v4.new_output
    run1 = nbformat.v4.new_code_cell(source="%%dist")
    run1.outputs = [
        out("stream", name="stdout", text="[rank 1] sum 10.0\n"),
        out("stream", name="stdout", text="[rank 0] sum 10.0\n[rank 0] pid 4242 in 1.5 s\n"),
        out("display_data", data={"text/plain": "  0  idle  dp0   vm   26701  cpu"}),
    ]
    run2 = nbformat.v4.new_code_cell(source="%%dist")
    run2.outputs = [
        out("stream", name="stdout", text="[rank 0] sum 10.0\n[rank 1] sum 10.0\n"),
        out("stream", name="stdout", text="[rank 0] pid 4242 in 0.25 s\n"),
        out("display_data", data={"text/plain": "  0  idle  dp0  node-7  811  cpu"}),
    ]
    assert cell_view(run1) == cell_view(run2)
    run2.outputs[0].text = "[rank 0] sum 10.0\n[rank 1] sum 9.0\n"  # a behaviour change
    assert cell_view(run1) != cell_view(run2)
    assert cell_view(run1, "shape") == cell_view(run2, "shape")
    collapsed = nbformat.v4.new_code_cell(source="%%dist --collapse")
    collapsed.outputs = [out("stream", name="stdout", text="[ranks 0,2-3] same\n")]
    apart = nbformat.v4.new_code_cell(source="%%dist --collapse")
    apart.outputs = [out("stream", name="stdout", text="[rank 3] same\n[ranks 0,2] same\n")]
    assert cell_view(collapsed) == cell_view(apart)


def _runner():
    """scripts/run_notebooks.py's ``execute``: the tests run notebooks as that script does."""
    path = os.path.join(REPO, "scripts", "run_notebooks.py")
    spec = importlib.util.spec_from_file_location("run_notebooks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_shows_committed(executed: nbformat.NotebookNode, path: str) -> None:
    """Each code cell of ``executed`` (a run of the notebook at ``path``, its widgets made
    static) shows what the committed copy shows; cells added to the run are not compared."""
    committed = nbformat.read(path, as_version=4)
    before = {c.id: c for c in committed.cells if c.cell_type == "code"}
    after = {c.id: c for c in executed.cells if c.cell_type == "code" and c.id in before}
    assert list(after) == list(before)
    for cell_id, cell in after.items():
        mode = MODES.get(cell_id, "exact")
        assert cell_view(cell, mode) == cell_view(before[cell_id], mode), (
            f"cell {cell_id} shows something else than the committed notebook "
            f"(regenerate with scripts/notebook_sources/build.py if intended):\n{cell.source}"
        )


RUN_HERE = [p for p in NOTEBOOKS if os.path.basename(p) not in EXPORTED]


@pytest.mark.notebooks
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", RUN_HERE, ids=[os.path.basename(p) for p in RUN_HERE])
def test_notebook_runs_top_to_bottom_and_shows_its_committed_outputs(path):
    from nbclient.exceptions import CellExecutionError

    runner = _runner()
    try:
        executed = runner.static_outputs(runner.execute(path, timeout=300))
    except CellExecutionError as e:  # nbclient's message names the cell and the traceback
        pytest.fail(f"{os.path.basename(path)} failed:\n{e}", pytrace=False)
    assert_shows_committed(executed, path)


def test_every_notebook_is_collected():
    assert NOTEBOOKS, "no notebooks/NN_*.ipynb found"
    assert set(EXPORTED) <= {os.path.basename(p) for p in NOTEBOOKS}  # run in test_export
    ids = {c.id for p in NOTEBOOKS for c in nbformat.read(p, as_version=4).cells}
    assert set(MODES) <= ids, set(MODES) - ids  # the exceptions name cells that exist
