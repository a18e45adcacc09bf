"""Pull and push through shared memory (issue 22): values as the ranks and the notebook meet
them, on real engines (``session4``), and no file of the session left in /dev/shm after any
transfer, failed or interrupted, nor after stop and a hard restart. The codec's own cases
(dtypes, views, parameters) also run in this process, without engines."""

from __future__ import annotations

import glob
import os
import pickle
import signal
import threading
import time

import numpy as np
import pytest
import torch

from infini_notebook import cluster
from infini_notebook.core.errors import DistCellError, DistInterrupted, DistUsageError
from infini_notebook.engine import shm_transport

pytestmark = pytest.mark.skipif(not shm_transport.usable(), reason="no writable /dev/shm")

BIG = 1 << 20  # elements: past MIN_BYTES whatever the dtype


def session_files(session) -> list[str]:
    return glob.glob(glob.escape(shm_transport.file_prefix(session.folder.path)) + "-*")


def mappings(session, pid: int | str = "self") -> int:
    """How many mappings of the session's shared-memory files (removed or not) ``pid`` has."""
    prefix = shm_transport.file_prefix(session.folder.path)
    with open(f"/proc/{pid}/maps") as f:
        return sum(prefix in line for line in f)


def on_ranks(session, expr: str, ranks=None) -> dict[int, str]:
    """``expr``'s value on each rank, as text."""
    res = session.run(expr, ranks=ranks, echo=False).results
    return {r: v["text/plain"] for r, v in res.items()}


def samples() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(BIG, generator=g),
        "bf16": torch.randn(BIG, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (BIG,), generator=g),
        "bool": torch.rand(BIG, generator=g) > 0.5,
        "c64": torch.randn(BIG, dtype=torch.complex64, generator=g),
        "view": torch.arange(4 * BIG, dtype=torch.float64).view(2048, -1).t()[::3, 1:],
        "small": torch.tensor([1.5, 2.5]),  # in the pickle, not in the file
        "empty": torch.zeros(0, 7),
        "scalar": torch.tensor(3),
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# ----- on real engines -------------------------------------------------------------------------


def test_tensors_of_every_kind_round_trip_through_shared_memory(session4):
    values = samples()
    session4.push(values)
    assert session_files(session4) == []  # removed once every rank answered
    # the ranks' tensors lie on a mapping of the (removed) push file
    mapped = on_ranks(session4, "sum('-push-' in l for l in open('/proc/self/maps'))")
    assert all(int(n) > 0 for n in mapped.values()), mapped
    for name, value in values.items():
        pulled = session4.pull(name)
        assert session_files(session4) == []
        assert sorted(pulled) == [0, 1, 2, 3]
        for r, got in pulled.items():
            assert same(got, value), (name, r)
    assert not values["view"].is_contiguous()
    kept = session4.pull("f32")
    assert mappings(session4) >= 4  # the kernel's values lie on the pull files' mappings
    del kept


def test_numpy_arrays_bytearrays_and_mixed_containers(session4):
    arr = np.arange(300_000, dtype=np.float32).reshape(500, 600)
    mixed = {
        "t": torch.ones(BIG, dtype=torch.int32),
        "list": [1, "two", torch.full((3,), 3.0), arr[:, ::2]],
        "raw": bytearray(b"x" * 200_000),
        "tuple": (None, 2.5, {"deep": torch.arange(BIG)}),
    }
    session4.push({"arr": arr, "mixed": mixed})
    back = session4.pull("mixed")[2]
    assert session_files(session4) == []
    assert same(back["t"], mixed["t"]) and back["list"][:2] == [1, "two"]
    assert same(back["list"][2], mixed["list"][2])
    assert np.array_equal(back["list"][3], arr[:, ::2])
    assert back["raw"] == mixed["raw"] and isinstance(back["raw"], bytearray)
    assert back["tuple"][:2] == (None, 2.5) and same(back["tuple"][2]["deep"], torch.arange(BIG))
    arrays = session4.pull("arr")
    assert all(np.array_equal(a, arr) and a.dtype == arr.dtype for a in arrays.values())
    assert on_ranks(session4, "type(arr).__name__, arr.flags.writeable")[1] == "('ndarray', True)"


def test_pushed_tensors_are_independent_per_rank_and_from_the_notebook(session4):
    x = torch.zeros(BIG)
    session4.push({"x": x})
    session4.run("x += 1", ranks=[0], echo=False)  # writes copy the pages (MAP_PRIVATE)
    assert on_ranks(session4, "x.sum().item()") == {
        0: f"{float(BIG)}",
        1: "0.0",
        2: "0.0",
        3: "0.0",
    }
    assert x.sum().item() == 0
    pulled = session4.pull("x")
    pulled[1] += 5  # the notebook's copies are ordinary, writable and separate too
    assert pulled[1].sum().item() == 5 * BIG and pulled[2].sum().item() == 0
    assert pulled[0].sum().item() == BIG
    assert on_ranks(session4, "x.sum().item()", ranks=[1]) == {1: "0.0"}
    session4.push({"x": x})  # the same value twice
    assert on_ranks(session4, "x.sum().item()") == {r: "0.0" for r in range(4)}


def test_push_and_pull_on_some_ranks(session4):
    session4.run("part = None", echo=False)
    session4.push({"part": torch.ones(BIG)}, ranks=[1, 3])
    assert on_ranks(session4, "part is None") == {0: "True", 1: "False", 2: "True", 3: "False"}
    got = session4.pull("part", ranks="1-3")
    assert sorted(got) == [1, 2, 3] and got[2] is None
    assert same(got[3], torch.ones(BIG))
    assert session_files(session4) == []


def test_code_values_keep_ipyparallel_path(session4):
    # a function defined in the notebook travels as code (ipyparallel cans it), beside a tensor
    notebook = {"__name__": "__main__"}
    exec("def scale(v):\n    return v * 3", notebook)
    session4.push({"scale": notebook["scale"], "v": torch.ones(BIG)})
    assert on_ranks(session4, "scale(v).sum().item()")[0] == f"{3.0 * BIG}"
    assert session_files(session4) == []


def test_the_ordinary_path_gives_the_same_values(session4, monkeypatch):
    monkeypatch.setattr(shm_transport, "enabled", False)
    values = samples()
    before = mappings(session4)
    session4.push({"f32": values["f32"], "view": values["view"]})
    for name in ("f32", "view"):
        pulled = session4.pull(name)
        assert all(same(v, values[name]) for v in pulled.values())
        assert mappings(session4) <= before  # nothing came through a file


def test_failures_leave_no_file_and_keep_their_messages(session4):
    session4.run("big = torch.ones(1 << 20)", echo=False)
    with pytest.raises(DistCellError) as e:
        session4.pull("nope")
    assert "NameError: name 'nope' is not defined on this rank" in str(e.value)
    assert "ranks 0-3" in e.value.summary
    assert session_files(session4) == []
    session4.run("if rank == 2:\n    del big", echo=False)
    with pytest.raises(DistCellError) as e:
        session4.pull("big")
    assert "rank 2" in e.value.summary and session_files(session4) == []
    with pytest.raises(DistUsageError, match="cannot send `lock` to the ranks: _thread.lock"):
        session4.push({"t": torch.ones(BIG), "lock": threading.Lock()})
    assert session_files(session4) == []
    with pytest.raises(DistCellError):  # the ranks cannot import this test module
        session4.push({"t": torch.ones(BIG), "obj": Unimportable()})
    assert session_files(session4) == []


class Unimportable:
    pass


SLOW = """\
import time
class Slow:
    def __reduce__(self):
        time.sleep(20)
        return (int, (0,))
slow = [torch.ones(1 << 20), Slow()]
"""


def test_an_interrupted_pull_leaves_no_file(session4):
    session4.run(SLOW, echo=False)
    main = threading.get_ident()
    timer = threading.Timer(2.0, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    with pytest.raises(DistInterrupted):
        session4.pull("slow")
    assert session_files(session4) == []
    deadline = time.monotonic() + 20  # the ranks were sent SIGINT: they come back
    while time.monotonic() < deadline:
        try:
            if on_ranks(session4, "1") == {r: "1" for r in range(4)}:
                break
        except Exception:
            time.sleep(0.5)
    assert session_files(session4) == []
    session4.run("del slow, Slow", echo=False)


@pytest.mark.timeout(300)
def test_a_1gb_tensor_round_trip(session4):
    big = torch.arange(1 << 28, dtype=torch.int32)  # 1 GiB
    session4.push({"huge": big}, ranks=[0, 1])
    back = session4.pull("huge", ranks=[0, 1])
    assert session_files(session4) == []
    assert all(same(v, big) for v in back.values())
    del back
    session4.run("del huge", ranks=[0, 1], echo=False)


def test_stop_and_hard_restart_remove_the_sessions_files():
    session = cluster.Session(cluster.plan_from_options(nprocs=1, timeout=30))
    session.start()
    try:
        session.push({"x": torch.ones(BIG)})
        leftover = shm_transport.new_path(session.folder.path, "pull") + "-0"
        open(leftover, "w").close()  # as a rank killed while it wrote would leave one
        session.restart(hard=True)
        assert session_files(session) == []
        open(leftover, "w").close()
    finally:
        session.stop()
    assert session_files(session) == [] and not os.path.exists(leftover)


# ----- the codec alone -------------------------------------------------------------------------


@pytest.fixture
def path(tmp_path):
    p = f"{shm_transport.SHM_DIR}/infini-notebook-test{os.getpid()}-{tmp_path.name}"
    yield p
    shm_transport.remove([p])


def test_pack_and_unpack_keep_values_and_write_only_large_buffers(path):
    values = samples()
    values["param"] = torch.nn.Parameter(torch.randn(BIG))
    values["grad"] = torch.randn(BIG).requires_grad_()
    values["conj"] = torch.randn(BIG, dtype=torch.complex64).conj()
    values["neg"] = torch.randn(BIG, dtype=torch.complex64).conj().imag
    packed = shm_transport.pack(values, path, create=True)
    assert len(packed.data) < 64 * 1024  # the values' bytes are in the file
    assert os.path.getsize(path) >= packed.size > 5 * BIG
    assert all(o % shm_transport.ALIGN == 0 for o, _ in packed.spans)
    one, two = shm_transport.unpack(packed, path), shm_transport.unpack(packed, path)
    os.remove(path)  # the mappings stay valid
    for name, value in values.items():
        assert same(one[name].detach(), value.detach()), name
        assert type(one[name]) is type(value) and one[name].requires_grad == value.requires_grad
    one["f32"].add_(1)  # copy-on-write: the other mapping is untouched
    assert same(two["f32"], values["f32"])


def test_small_values_need_no_file(path):
    packed = shm_transport.pack({"a": 1, "t": torch.ones(3)}, path, create=True)
    assert packed.spans == () and not os.path.exists(path)
    assert same(shm_transport.unpack(packed, None)["t"], torch.ones(3))


def test_tensors_torch_pickles_itself_keep_its_path(path):
    t = torch.ones(BIG)
    t.note = "kept"
    packed = shm_transport.pack({"t": t, "sparse": torch.eye(600).to_sparse()}, path, create=True)
    back = shm_transport.unpack(packed, path)
    assert back["t"].note == "kept" and torch.equal(back["sparse"].to_dense(), torch.eye(600))
    assert len(packed.data) > 4 * BIG  # ``t`` went into the pickle, as torch pickles it


def test_a_pull_file_must_exist_and_the_value_falls_back(path):
    t = torch.ones(BIG)
    assert shm_transport.pack_or_value(t, path) is t  # no file made by the kernel
    assert not os.path.exists(path)
    assert shm_transport.pack_or_value(same, path) is same  # code keeps ipyparallel's path
    open(path, "w").close()
    packed = shm_transport.pack_or_value(t, path)
    assert same(shm_transport.received(packed, path), t)


def test_spans_are_aligned_and_names_carry_the_session_folder():
    assert shm_transport.spans_for([1, 64, 65, 0, 3]) == (
        (0, 1),
        (64, 64),
        (128, 65),
        (256, 0),
        (256, 3),
    )
    assert (
        shm_transport.file_prefix("/tmp/infini-notebook-ab12/") == "/dev/shm/infini-notebook-ab12"
    )
    name = shm_transport.new_path("/tmp/infini-notebook-ab12", "push")
    assert name.startswith("/dev/shm/infini-notebook-ab12-push-")


def test_the_pickle_is_protocol_5(path):
    packed = shm_transport.pack([np.ones(100_000)], path, create=True)
    assert packed.data[:2] == pickle.PROTO + bytes([5]) and packed.spans
