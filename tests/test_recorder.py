"""Reading Flight Recorder dumps (core/recorder.py): an NCCL dump in torch 2.13's schema (a
fixture built from FlightRecorder::dump_json, FlightRecorderDetail.hpp: a CPU wheel has no
NCCL recorder to dump), and gloo's recorder, dumped for real."""

from __future__ import annotations

import json
import os

from conftest import REPO

from infini_notebook.core import recorder

FIXTURE = os.path.join(REPO, "tests", "fixtures", "nccl_flight_recorder_2.13.json")


def nccl_dump() -> dict:
    with open(FIXTURE) as f:
        return json.load(f)


def test_nccl_the_wait_is_the_oldest_entry_past_what_its_group_completed():
    dump = nccl_dump()
    # record 1 says "scheduled" but its group (tp) completed seq 2; record 3 timed out
    assert [e["record_id"] for e in recorder.pending(dump)] == [5]
    assert recorder.oldest_wait(dump) == {
        "op": "all_reduce", "group": "world", "ranks": [0, 1, 2, 3], "peer": None, "seq": 4,
        "name": "0",
    }  # fmt: skip


def test_nccl_nothing_pending_once_the_group_completed_it():
    dump = nccl_dump()
    dump["pg_status"]["0"]["last_completed_collective"] = "4"
    assert recorder.pending(dump) == [] and recorder.oldest_wait(dump) is None


def test_a_layout_group_is_named_by_its_kind_and_p2p_by_its_own_number():
    dump = nccl_dump()
    dump["entries"].append(
        dict(
            dump["entries"][1],
            record_id=9,
            collective_seq_id=0,
            p2p_seq_id=3,
            is_p2p=True,
            profiling_name="nccl:send 0->1",
        )  # fmt: skip
    )
    dump["pg_status"]["0"]["last_completed_collective"] = "4"
    wait = recorder.oldest_wait(dump)
    assert wait["group"] == "tp" and wait["seq"] == 3 and wait["ranks"] == [0, 1]
    assert recorder.oldest_wait(dump, collectives_only=True) is None
    assert recorder.newest_entry(dump, "1")["collective_seq_id"] == 2


def test_gloo_entries_stay_scheduled_yet_are_not_pending_once_done():
    """gloo's recorder, as torch 2.13 writes it after four all_reduces that ended (seen on a
    real gloo group: state 'scheduled' for ever, 'retired' and pg_status say they ended)."""
    done = {
        "pg_status": {"0": {"last_completed_collective": "4"}},
        "pg_config": {"": {"desc": "", "name": "", "ranks": "[0, 1]"}},
        "entries": [
            {"record_id": i, "pg_id": 0, "process_group": ["0", "default_pg"],
             "collective_seq_id": i + 1, "state": "scheduled", "retired": True, "is_p2p": False,
             "profiling_name": "gloo:all_reduce"}
            for i in range(4)
        ],
    }  # fmt: skip
    assert recorder.pending(done) == []
    waiting = json.loads(json.dumps(done))
    waiting["entries"][3].update(retired=False)
    waiting["pg_status"]["0"]["last_completed_collective"] = "3"
    assert recorder.oldest_wait(waiting)["seq"] == 4


def test_a_group_is_named_alike_in_errors_and_in_the_profile():
    """recorder.group_label names groups for the waits (errors) and the profile's rows."""
    from infini_notebook.core import timeline

    labels = {d: recorder.group_label(d) for d in ("default_pg", "inb_tp", "inb_cp_dp")}
    assert labels == {"default_pg": "world", "inb_tp": "tp", "inb_cp_dp": "cp dp"}
    assert recorder.group_label("inb_cpu_tp") == "tp (gloo twin)"
    assert recorder.group_label("inb_cpu_tp-cp-dp-pp") == "world (gloo twin)"  # not the dims
    assert timeline._group_label("3", "inb_tp", [2, 3]) == "tp [ranks 2-3]"
    assert timeline._group_label("0", "default_pg", [0, 1, 2, 3]) == "world"


def test_a_collective_is_numbered_within_the_cell_by_its_kind_on_its_group():
    """Issue 40 item 5: "the cell's 1st all_reduce (#3 on the world group)". Entries made
    before the cell started (the bootstrap's, an earlier cell's) do not count, nor other
    ops or groups; a recorder that may have dropped some of the cell's entries says nothing."""

    def entry(i, t, name="gloo:all_reduce", group=("0", "default_pg")):
        return {"record_id": i, "time_created_ns": t, "profiling_name": name, "is_p2p": False,
                "process_group": list(group), "collective_seq_id": i + 1}  # fmt: skip

    entries = [
        entry(0, 10), entry(1, 20),  # before the cell (started at 100)
        entry(2, 110, "gloo:broadcast"), entry(3, 120, group=("1", "inb_tp")),
        entry(4, 130), entry(5, 140),
    ]  # fmt: skip
    dump = {"entries": entries}
    assert recorder.nth_in_cell(dump, entries[4], 100, capacity=200) == 1
    assert recorder.nth_in_cell(dump, entries[5], 100, capacity=200) == 2
    assert recorder.nth_in_cell(dump, entries[2], 100, capacity=200) == 1  # its broadcast
    assert recorder.nth_in_cell(dump, entries[4], None, capacity=200) is None  # no cell
    # a full ring holding only the cell's entries: older ones of the cell may be gone
    assert recorder.nth_in_cell({"entries": entries[2:]}, entries[4], 100, capacity=4) is None
    assert recorder.nth_in_cell(dump, entries[4], 100, capacity=6) == 1  # older ones kept
