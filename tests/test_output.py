"""Output fidelity in a real kernel (issue 19): progress lines rewritten with \\r, tqdm's
text bars, writes straight to fd 1/2, output of threads after their cell, and the private
ipyparallel/ipykernel parts this depends on. Each table row of the issue at 2 and 4 ranks."""

from __future__ import annotations

import os
import queue
import re
import signal
import threading
import time

import pytest
from conftest import text_of, use_session
from jupyter_core.utils import run_sync

from infini_notebook.core.ranks import rank_label

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def ranks(request, kernel):
    use_session(kernel, f"--nprocs {request.param}")
    return request.param


class Displays:
    """Every state a cell's displays went through (nbclient keeps only the last)."""

    def __init__(self, kernel):
        self.kernel, self.states = kernel, []
        self.original = kernel.client.process_message

    def __enter__(self):
        def record(msg, cell, cell_index):
            if msg["msg_type"] in ("display_data", "update_display_data"):
                self.states.append(msg["content"]["data"].get("text/plain", ""))
            return self.original(msg, cell, cell_index)

        self.kernel.client.process_message = record
        return self

    def __exit__(self, *exc):
        self.kernel.client.process_message = self.original


def stream_lines(cell, name: str) -> list[str]:
    return text_of(cell, name).splitlines()


def live_text(cell) -> str:
    return "".join(
        o.get("data", {}).get("text/plain", "") for o in cell.outputs if o.output_type != "stream"
    )


# ----- row 1: a line rewritten with \r --------------------------------------------------------
STEPS = """%%dist
import time
for i in range(6):
    print(f'\\rstep {i}', end='', flush=True)
    time.sleep(0.15)
print(' done')"""


def test_a_carriage_return_line_updates_in_place_and_ends_exact(kernel, ranks):
    with Displays(kernel) as shown:
        cell = kernel.run(STEPS)
    assert sorted(stream_lines(cell, "stdout")) == [f"[rank {r}] step 5 done" for r in range(ranks)]
    assert live_text(cell) == ""  # the live display is emptied: its last state is above
    lines = [line for state in shown.states for line in state.splitlines()]
    assert any(re.fullmatch(r"\[rank \d\] step [0-4]", line) for line in lines), shown.states
    for state in shown.states:  # one line per rank, each a whole update: nothing leaks
        assert all(re.fullmatch(r"\[rank (\d)\] step \d", line) for line in state.splitlines())
        labels = re.findall(r"\[rank (\d)\]", state)
        assert len(labels) == len(set(labels))


# ----- row 2: tqdm's text bar (\r on stderr) --------------------------------------------------
TQDM = """%%dist
import time
from tqdm import tqdm
for _ in tqdm(range(30), desc=f'r{rank}'):
    time.sleep(0.02)"""


def assert_bars_finished(cell, ranks: int, total: int) -> None:
    lines = stream_lines(cell, "stderr")
    assert len(lines) == ranks, lines  # one final bar per rank, nothing else
    for r, line in enumerate(sorted(lines, key=lambda x: int(x.split()[1][:-1]))):
        assert line.startswith(f"[rank {r}] r{r}: 100%|"), line
        assert f"| {total}/{total} [" in line and line.count("it/s]") == 1, line


def test_tqdm_text_bars_update_in_place_and_end_at_100_percent(kernel, ranks):
    with Displays(kernel) as shown:
        cell = kernel.run(TQDM)
    assert_bars_finished(cell, ranks, 30)
    partial = [s for s in shown.states if re.search(r"\[rank \d\] r\d: +\d+%\|", s)]
    assert partial, shown.states  # bars were shown while they ran


def test_tqdm_auto_bars_are_forwarded_widgets_labeled_on_their_line(kernel, ranks):
    """Each rank's bar widget reaches the notebook inside a box that starts with its rank's
    label (issue 33, item 5: not a label line above the bar)."""
    cell = kernel.run(
        "%%dist\nfrom tqdm.auto import tqdm\nfor _ in tqdm(range(5), desc=f'r{rank}'):\n"
        "    pass\nprint('after', rank)"
    )
    view = "application/vnd.jupyter.widget-view+json"
    widgets = [o for o in cell.outputs if view in o.get("data", {})]
    assert len(widgets) == ranks  # one bar per rank
    state = kernel.client.widget_state
    labels = []
    for output in widgets:
        box = state[output["data"][view]["model_id"]]
        assert box["_model_name"] == "HBoxModel", box
        label, bar = (state[child.removeprefix("IPY_MODEL_")] for child in box["children"])
        labels.append(label["value"])
        assert bar["_model_name"] == "HBoxModel" and len(bar["children"]) == 3  # tqdm's bar
        progress = state[bar["children"][1].removeprefix("IPY_MODEL_")]
        assert progress["value"] == progress["max"] == 5  # the bar itself runs to the end
        assert output["metadata"].get("infini_notebook_labeled") is True
        assert "|" in output["data"]["text/plain"]  # tqdm's text bar, kept for text views
    assert labels == [f"<code>[rank {r}]</code>" for r in range(ranks)]  # in rank order
    lines = stream_lines(cell, "stdout")
    assert sorted(lines) == [f"[rank {r}] after {r}" for r in range(ranks)]  # no label lines


# ----- row 3: writes straight to fd 1/2 -------------------------------------------------------
def test_fd_writes_at_the_end_of_a_cell_reach_that_cell_for_every_rank(kernel, ranks):
    for _ in range(3):  # a race lost once in a while would show here
        cell = kernel.run(
            "%%dist\nimport ctypes, os\nctypes.CDLL(None).printf(b'c-stdio %d\\n', rank)\n"
            "_ = os.write(2, f'r{rank} tail-written\\n'.encode())"
        )
        assert sorted(stream_lines(cell, "stderr")) == [
            f"[rank {r}] r{r} tail-written" for r in range(ranks)
        ]
        assert sorted(stream_lines(cell, "stdout")) == [
            f"[rank {r}] c-stdio {r}" for r in range(ranks)
        ]


def test_output_of_a_thread_after_its_cell_shows_in_the_next_cell_marked_late(kernel, ranks):
    kernel.run(
        "%%dist\nimport os, threading, time\nsaid = []\ndef later():\n    time.sleep(0.5)\n"
        "    print('thread says', rank)\n    os.write(2, b'fd says\\n')\n    said.append(1)\n"
        "threading.Thread(target=later).start()"
    )
    kernel.run(  # until every rank's thread wrote: after its cell, before the next
        "import time\nwhile not all(dist_session.pull('said').values()):\n    time.sleep(0.05)"
    )
    cell = kernel.run("%%dist\nprint('next', rank)")
    out, err = text_of(cell, "stdout"), text_of(cell, "stderr")
    for r in range(ranks):
        assert f"[rank {r}] (late) thread says {r}" in out
        assert f"[rank {r}] next {r}" in out
    assert f"{rank_label(list(range(ranks)))} (late) fd says" in err  # the same: one line
    assert "(late)" not in text_of(kernel.run("%%dist\nprint('again', rank)"))  # shown once


BUTTON = """%%dist
import ipywidgets, threading
button = ipywidgets.Button(description=f'r{rank}')
def clicked(_):
    print('clicked on', rank)
    print('the same on every rank')
    timer = threading.Timer(0.05, lambda: print('timer on', rank))  # a thread of its own
    timer.start()
    timer.join()
button.on_click(clicked)
display(button)"""


def click(kernel, model_id: str) -> None:
    """What JupyterLab sends when a Button is clicked: a comm message to the notebook's
    kernel, which ipyparallel relays to the rank that owns the widget. The rank runs the
    callback for that message, outside any cell."""
    data = {"method": "custom", "content": {"event": "click"}}
    kc = kernel.client.kc
    kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": model_id, "data": data}))


def widget_states(kernel, done, timeout: float = 60) -> dict:
    """The widgets' states as a frontend sees them (comm messages on iopub) once ``done``
    says so of them: between cells nbclient reads no message, so they are read here."""
    kc, states = kernel.client.kc, {}
    deadline = time.monotonic() + timeout
    while not done(states):
        assert time.monotonic() < deadline, states
        try:
            msg = run_sync(kc.iopub_channel.get_msg)(timeout=1)
        except queue.Empty:
            continue
        if msg["msg_type"] in ("comm_open", "comm_msg"):
            data = msg["content"].get("data") or {}
            states.setdefault(msg["content"]["comm_id"], {}).update(data.get("state") or {})
    return states


def test_a_widget_callbacks_print_shows_under_it_at_once_and_is_in_the_ranks_file(kernel, ranks):
    """Issue 50: a print in a Button's on_click on a rank (and a timer it starts) appeared
    nowhere. It shows at once beside the rank's button, in the cell that showed it, and is
    in the rank's output file; the next cell does not show it again."""
    cell = kernel.run(BUTTON)
    view = "application/vnd.jupyter.widget-view+json"
    state = kernel.client.widget_state
    buttons, boxes = {}, {}
    for output in (o for o in cell.outputs if view in o.get("data", {})):
        box = output["data"][view]["model_id"]
        label, button = state[box]["children"]
        rank = int(re.search(r"rank (\d+)", state[label.removeprefix("IPY_MODEL_")]["value"])[1])
        buttons[rank], boxes[rank] = button.removeprefix("IPY_MODEL_"), box
    assert sorted(buttons) == list(range(ranks))
    for r in range(ranks):
        click(kernel, buttons[r])
    want = {r: f"clicked on {r}\nthe same on every rank\ntimer on {r}\n" for r in range(ranks)}

    def shown(states) -> dict[int, str]:
        """Each rank's text in the Output its box holds after its button."""
        texts = {}
        for r, box in boxes.items():
            children = states.get(box, {}).get("children", [])[2:]
            for child in children:
                parts = states.get(child.removeprefix("IPY_MODEL_"), {}).get("outputs", [])
                texts[r] = "".join(p["text"] for p in parts if p["name"] == "stdout")
        return texts

    assert shown(widget_states(kernel, lambda states: shown(states) == want)) == want
    cell = kernel.run("%%dist\nprint('next', rank)")  # the frontend saw it: not again
    assert stream_lines(cell, "stdout") == [f"[rank {r}] next {r}" for r in range(ranks)]
    files = text_of(kernel.run("print(dist_session.folder.file('output'))")).strip()
    for r in range(ranks):
        with open(os.path.join(files, f"rank{r}.stdout")) as f:
            kept = f.read()
        for line in want[r].splitlines():
            assert f"(late, shown under its widget) {line}\n" in kept, kept


def test_a_threads_print_between_cells_every_rank_the_same_is_one_late_line(kernel, ranks):
    """Issue 50: identical late lines (c10d's at 64 ranks) came one per rank."""
    kernel.run(
        "%%dist\nimport threading\nticked = []\n"
        "threading.Timer(0.2, lambda: (print('tick'), ticked.append(1))).start()"
    )
    kernel.run(  # until every rank's timer printed: after its cell, before the next
        "import time\nwhile not all(dist_session.pull('ticked').values()):\n    time.sleep(0.05)"
    )
    cell = kernel.run("%%dist\nprint('next', rank)")
    assert stream_lines(cell, "stdout") == [f"{rank_label(list(range(ranks)))} (late) tick"] + [
        f"[rank {r}] next {r}" for r in range(ranks)
    ]


def test_ten_thousand_carriage_return_updates_end_in_one_exact_line(kernel, ranks):
    cell = kernel.run(
        "%%dist\nfor i in range(10_000):\n    print(f'\\rline {i}', end='')\nprint()",
        timeout=300,
    )
    assert sorted(stream_lines(cell, "stdout")) == [f"[rank {r}] line 9999" for r in range(ranks)]
    assert len(text_of(cell)) < 100 * ranks  # the updates themselves are not kept


# ----- item 4: the private internals we patch, in effect on a real engine -----------------------
def test_engine_patches_are_in_effect_on_every_rank(kernel, ranks):
    cell = kernel.run(
        "%%dist\nfrom infini_notebook.engine import output_streams as engine_output\n"
        "from infini_notebook.engine import tuning as engine_tuning\n"
        "print(all(engine_tuning.in_effect().values()), engine_output.installed(),\n"
        "      all(p.idle() for p in engine_output._state['pipes']))"  # no marker needed now
    )
    expected = [f"[rank {r}] True ['fd sync', 'late output'] True" for r in range(ranks)]
    assert sorted(stream_lines(cell, "stdout")) == expected


def test_a_missing_internal_fails_naming_the_versions():
    from infini_notebook.core import internals

    with pytest.raises(RuntimeError, match=r"ipyparallel \d+\.\d+.* has no _children"):
        internals.require(object(), ("_children",), "ipyparallel", "AsyncResult")
    assert internals.usable(object(), ("_buffers",), "ipykernel", "OutStream") is False


# ----- item 5: small things a user sees ---------------------------------------------------------
def test_an_interrupted_cell_releases_its_message_records(kernel, ranks):
    def press_stop():
        time.sleep(1.5)
        os.kill(kernel.kernel_pid, signal.SIGINT)  # Jupyter's stop button

    threading.Thread(target=press_stop).start()
    kernel.run("%%dist\nimport time\ntime.sleep(30)", allow_error=True, timeout=60)
    cell = kernel.run(
        "c = dist_session.engines.client.ipp_client\nwith dist_session.engines.client.lock:\n"
        "    print(len(c.history), len(c.results), len(set(c.metadata) - {'submitted'}))"
    )
    assert text_of(cell).split() == ["0", "0", "0"]


def test_a_cell_ended_by_a_dead_rank_releases_the_records_of_the_others(kernel, ranks):
    cell = kernel.run(
        "%%dist\nimport os, time\nif rank == 1:\n    os._exit(3)\ntime.sleep(3)",
        allow_error=True,
        timeout=60,
    )
    assert "rank 1" in text_of(cell) and "%dist_restart --hard" in text_of(cell)
    # The others finish (they wait in no collective); their records go as their replies
    # come (at the next cell's clean-up); the dead rank's once the controller fails it.
    count = (
        "import time\nc = dist_session.engines.client.ipp_client\nfor _ in range(20):\n"
        "    try:  # right after an interrupt the engine may abort it: its clean-up runs\n"
        "        dist_session.run('pass', ranks='0', echo=False)\n"
        "    except Exception:\n        pass\n"
        "    with dist_session.engines.client.lock:\n"
        "        left = (len(c.history), len(c.results))\n"
        "    if left[0] <= 1 and left[1] == 0:\n        break\n    time.sleep(0.5)\nprint(*left)"
    )
    history, results = map(int, text_of(kernel.run(count)).split())
    assert history <= 1 and results == 0  # the dead rank's may stay until its engine is gone
    kernel.run("%dist_restart --hard", timeout=180)


# ----- 8 ranks of bars -------------------------------------------------------------------------
def test_eight_ranks_of_tqdm_bars_stay_one_line_per_rank(kernel):
    use_session(kernel, "--nprocs 8")
    with Displays(kernel) as shown:
        cell = kernel.run(TQDM.replace("30", "20").replace("0.02", "0.05"), timeout=300)
    assert_bars_finished(cell, 8, 20)
    for state in shown.states:
        labels = re.findall(r"\[rank (\d)\]", state)
        assert len(labels) == len(set(labels)) == len(state.splitlines())
    assert max(len(s.splitlines()) for s in shown.states) >= 2  # several bars live at once


def test_a_refused_dist_start_draws_no_progress_bar(kernel):
    running = "from infini_notebook import cluster as _c\nprint(_c.current() is not None)"
    if text_of(kernel.run(running)).strip() != "True":
        use_session(kernel, "--nprocs 2")
    for flags in ("--nprocs 2", None, "--nprocs 4 --tp 3"):  # None: stop, then bad flags
        if flags is None:
            use_session(kernel, None)
            continue
        cell = kernel.run(f"%dist_start {flags}", allow_error=True)
        assert [o.output_type for o in cell.outputs] == ["error"], cell.outputs
        assert "DistUsageError" in text_of(cell)
