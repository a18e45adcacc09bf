"""Pull and push through shared memory (issue 22): values as the ranks and the notebook meet
them, on real engines (``session4``), and no file of the session left in /dev/shm after any
transfer, failed or interrupted, nor after stop and a hard restart. The codec's own cases
(dtypes, views, parameters) also run in this process, without engines."""

from __future__ import annotations

import glob
import os
import pickle
import signal
import struct
import threading
import time

import numpy as np
import pytest
import torch
from other_user import OTHER_UID, Recreator, as_other, needs_root

from infini_notebook import cluster
from infini_notebook.core.errors import DistCellError, DistInterrupted, DistUsageError
from infini_notebook.engine import shm_transport

pytestmark = pytest.mark.skipif(not shm_transport.usable(), reason="no writable /dev/shm")

BIG = 1 << 20  # elements: past MIN_BYTES whatever the dtype


def session_files(session) -> list[str]:
    """The session's files in /dev/shm: under its prefix, or in a folder there."""
    found = []
    for entry in glob.glob(glob.escape(shm_transport.file_prefix(session.folder.path)) + "-*"):
        if os.path.isdir(entry) and not os.path.islink(entry):
            found += [os.path.join(entry, name) for name in os.listdir(entry)]
        else:
            found.append(entry)
    return found


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
    mapped = on_ranks(session4, "sum('/push-' in l for l in open('/proc/self/maps'))")
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
    main, pulling = threading.get_ident(), threading.Event()

    def interrupt_mid_transfer():  # once every rank wrote its file: else nothing to leave
        deadline = time.monotonic() + 15  # the ranks stall for 20 s
        while len(session_files(session4)) < 4:
            if time.monotonic() > deadline or not pulling.is_set():
                return  # never into whatever the main thread runs next
            time.sleep(0.05)
        time.sleep(1.5)  # into the wait for the stalled ranks: the gap between a pull's steps
        # does not turn Stop into DistInterrupted (a raw KeyboardInterrupt crashed a worker)
        if pulling.is_set():
            signal.pthread_kill(main, signal.SIGINT)

    pulling.set()
    threading.Thread(target=interrupt_mid_transfer, daemon=True).start()
    try:
        with pytest.raises(DistInterrupted):
            session4.pull("slow")
    finally:
        pulling.clear()
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


# ----- another user at /dev/shm (issue 44.2) ---------------------------------------------------

# Keeps a rank busy (an interrupt does not end it): calls sent after it wait in its queue.
BUSY = """\
import time
_end = time.time() + {seconds}
while time.time() < _end:
    try:
        time.sleep(0.02)
    except KeyboardInterrupt:
        pass
"""


def wait_for_ranks(session, timeout: float = 30) -> None:
    """Until every rank answers a cell: what was queued before it has run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if on_ranks(session, "1") == {r: "1" for r in range(4)}:
                return
        except Exception:
            time.sleep(0.3)
    raise TimeoutError("the ranks did not come back")


class Attack:
    """While a transfer runs, uid 65534 re-creates each of the session's files in /dev/shm
    as soon as the kernel removed it, world-writable, holding ``content`` (``planted``: the
    test does it as root, then gives the file to uid 65534, as if the folder had let them
    in). ``read`` is what the attacker's files held once the ranks were done."""

    def __init__(self, session, content: bytes, planted: bool):
        self.session, self.content, self.planted = session, content, planted
        self.seen: set[str] = set()
        self.made: list[str] = []
        self.errors: dict[str, str] = {}
        self.read: dict[str, bytes] = {}
        self._stop = threading.Event()

    def __enter__(self):
        self.other = None if self.planted else Recreator(self.content)
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.is_set():
            for path in session_files(self.session):
                if path not in self.seen:
                    self.seen.add(path)
                    if self.other:
                        self.other.watch(path)
            if self.planted:
                for path in self.seen - set(self.made):
                    if not os.path.lexists(path):
                        self._plant(path)
            time.sleep(0.002)

    def _plant(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        os.write(fd, self.content)
        os.fchown(fd, OTHER_UID, OTHER_UID)
        os.fchmod(fd, 0o666)
        os.close(fd)
        self.made.append(path)

    def __exit__(self, *exc):
        wait_for_ranks(self.session)  # the ranks' queued calls have run
        self._stop.set()
        self.thread.join()
        if self.other:
            report = self.other.stop()
            self.made, self.errors = report["made"], report["errors"]
            self.read = {p: bytes.fromhex(h) for p, h in report["read"].items()}
        else:
            for path in self.made:
                with open(path, "rb") as f:
                    self.read[path] = f.read()
        shm_transport.remove(self.made)
        return False


def interrupted_while_queued(session, call, busy_s: float = 3.0, after_s: float = 1.0) -> None:
    """``call`` (a pull or push) sent while every rank is still busy with earlier work, and
    interrupted after ``after_s``: the kernel gives up and removes its files while the
    ranks' calls wait in their queues, to run when the work ends."""
    with session.engines.client.lock:
        busy = session.engines.view([0, 1, 2, 3]).execute(BUSY.format(seconds=busy_s), block=False)
    timer = threading.Timer(after_s, signal.pthread_kill, (threading.get_ident(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(DistInterrupted):
            call()
    finally:
        timer.cancel()
        session.engines.client.forget(busy.msg_ids)


@needs_root
@pytest.mark.parametrize("planted", [False, True], ids=["other-user", "planted-file"])
def test_an_interrupted_pull_writes_no_file_made_after_it(session4, planted):
    """The engine's queued pull finds no file of the other user's to write the secret in."""
    session4.run("secret = torch.full((1 << 20,), 42.0)", echo=False)
    with Attack(session4, b"", planted) as attack:
        interrupted_while_queued(session4, lambda: session4.pull("secret"))
    assert len(attack.seen) == 4  # the kernel's files, one per rank, removed on the interrupt
    leaked = [p for p, data in attack.read.items() if struct.pack("4f", *[42.0] * 4) in data]
    assert leaked == [], f"the secret went into {leaked}"
    if not planted:  # the other user cannot even make one (a 0700 folder of the session's)
        assert attack.made == [] and set(attack.errors.values()) == {"Permission denied"}
    else:
        assert len(attack.made) == 4 and all(d == b"" for d in attack.read.values())
    assert session_files(session4) == []
    session4.run("del secret", echo=False)


@needs_root
@pytest.mark.parametrize("planted", [False, True], ids=["other-user", "planted-file"])
def test_an_interrupted_push_reads_no_file_made_after_it(session4, planted):
    """The engine's queued push finds no file of the other user's to take the values from."""
    session4.run("pushed = None", echo=False)
    sevens = struct.pack("f", 7.0) * BIG
    with Attack(session4, sevens, planted) as attack:
        interrupted_while_queued(session4, lambda: session4.push({"pushed": torch.ones(BIG)}))
    assert len(attack.seen) == 1
    assert on_ranks(session4, "pushed is None") == {r: "True" for r in range(4)}  # nothing set
    if not planted:
        assert attack.made == [] and set(attack.errors.values()) == {"Permission denied"}
    else:
        assert len(attack.made) == 1
    assert session_files(session4) == []


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
        shm_dir = session.folder.shm_dir()
        assert os.stat(shm_dir).st_mode & 0o777 == 0o700
        leftover = shm_transport.new_segment(shm_dir, "pull-0").path  # not removed: a killed kernel
        session.restart(hard=True)
        assert session_files(session) == []
        shm_transport.new_segment(shm_dir, "pull-0")
    finally:
        session.stop()
    assert session_files(session) == [] and not os.path.exists(os.path.dirname(leftover))


# ----- the codec alone -------------------------------------------------------------------------


@pytest.fixture
def shm_dir(tmp_path):
    d = shm_transport.make_dir(f"/tmp/infini-notebook-test{os.getpid()}{tmp_path.name}")
    yield d
    shm_transport.remove_session_dirs(f"/tmp/infini-notebook-test{os.getpid()}{tmp_path.name}")
    assert not os.path.exists(d)


@pytest.fixture
def seg(shm_dir):
    return shm_transport.new_segment(shm_dir, "test")


def test_pack_and_unpack_keep_values_and_write_only_large_buffers(seg):
    values = samples()
    values["param"] = torch.nn.Parameter(torch.randn(BIG))
    values["grad"] = torch.randn(BIG).requires_grad_()
    values["conj"] = torch.randn(BIG, dtype=torch.complex64).conj()
    values["neg"] = torch.randn(BIG, dtype=torch.complex64).conj().imag
    packed = shm_transport.pack(values, seg)
    assert len(packed.data) < 64 * 1024  # the values' bytes are in the file
    assert os.path.getsize(seg.path) >= packed.size > 5 * BIG
    assert all(o % shm_transport.ALIGN == 0 for o, _ in packed.spans)
    one, two = shm_transport.unpack(packed, seg), shm_transport.unpack(packed, seg)
    os.remove(seg.path)  # the mappings stay valid
    for name, value in values.items():
        assert same(one[name].detach(), value.detach()), name
        assert type(one[name]) is type(value) and one[name].requires_grad == value.requires_grad
    one["f32"].add_(1)  # copy-on-write: the other mapping is untouched
    assert same(two["f32"], values["f32"])


def test_small_values_need_no_file(seg):
    packed = shm_transport.pack({"a": 1, "t": torch.ones(3)}, seg)
    assert packed.spans == () and os.path.getsize(seg.path) == 0
    assert same(shm_transport.unpack(packed, None)["t"], torch.ones(3))


def test_tensors_torch_pickles_itself_keep_its_path(seg):
    t = torch.ones(BIG)
    t.note = "kept"
    packed = shm_transport.pack({"t": t, "sparse": torch.eye(600).to_sparse()}, seg)
    back = shm_transport.unpack(packed, seg)
    assert back["t"].note == "kept" and torch.equal(back["sparse"].to_dense(), torch.eye(600))
    assert len(packed.data) > 4 * BIG  # ``t`` went into the pickle, as torch pickles it


def test_a_pull_file_must_be_the_kernels_and_the_value_falls_back(seg):
    t = torch.ones(BIG)
    os.remove(seg.path)
    assert shm_transport.pack_or_value(t, seg) is t  # the kernel removed its file
    assert not os.path.exists(seg.path)
    os.close(os.open(seg.path, os.O_CREAT | os.O_WRONLY, 0o600))  # another file, same path
    assert shm_transport.pack_or_value(t, seg) is t and os.path.getsize(seg.path) == 0
    os.remove(seg.path)
    os.symlink(os.path.join(os.path.dirname(seg.path), "target"), seg.path)  # a link
    assert shm_transport.pack_or_value(t, seg) is t
    assert not os.path.exists(os.path.join(os.path.dirname(seg.path), "target"))
    os.remove(seg.path)
    assert shm_transport.pack_or_value(same, seg) is same  # code keeps ipyparallel's path
    kernels = shm_transport.new_segment(os.path.dirname(seg.path), "pull-0")
    packed = shm_transport.pack_or_value(t, kernels)
    assert same(shm_transport.received(packed, kernels), t)


def test_what_makes_a_file_not_the_kernels():
    seg = shm_transport.Segment("/dev/shm/x/f", dev=1, ino=2, uid=0, mode=0o600)

    def st(mode=0o100600, ino=2, dev=1, uid=0):
        return os.stat_result((mode, ino, dev, 1, uid, 0, 0, 0, 0, 0))

    assert shm_transport.segment_problem(st(), seg) is None
    assert "another file" in shm_transport.segment_problem(st(ino=3), seg)
    assert "another file" in shm_transport.segment_problem(st(dev=9), seg)
    assert "uid 65534" in shm_transport.segment_problem(st(uid=65534), seg)
    assert "mode 666" in shm_transport.segment_problem(st(mode=0o100666), seg)
    assert "regular" in shm_transport.segment_problem(st(mode=0o040700), seg)


def test_the_sessions_folder_in_dev_shm_is_its_own(shm_dir):
    st = os.lstat(shm_dir)
    assert st.st_mode & 0o777 == 0o700 and st.st_uid == os.geteuid()
    assert os.path.basename(shm_dir).startswith(f"infini-notebook-test{os.getpid()}")
    assert shm_transport.own_dir_problem(st, os.geteuid()) is None


@needs_root
def test_removing_a_sessions_folders_leaves_other_users_alone(tmp_path):
    """Only folders of ours with mode 0700 named after the session go: not another user's
    folder or link with the same prefix."""
    workdir = f"/tmp/infini-notebook-t{os.getpid()}x"
    prefix = shm_transport.file_prefix(workdir)

    def plant(prefix: str) -> list[str]:
        os.mkdir(prefix + "-theirs", 0o777)
        os.symlink(prefix + "-theirs", prefix + "-link")
        return os.listdir("/dev/shm")

    ours = shm_transport.make_dir(workdir)
    assert "error" not in as_other(plant, prefix)
    try:
        shm_transport.remove_session_dirs(workdir)
        assert not os.path.exists(ours)
        assert os.path.isdir(prefix + "-theirs") and os.path.islink(prefix + "-link")
    finally:
        os.remove(prefix + "-link")
        os.rmdir(prefix + "-theirs")


def test_spans_are_aligned_and_folders_carry_the_session_folder_name():
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
    d = shm_transport.make_dir("/tmp/infini-notebook-ab12")
    try:
        assert d.startswith("/dev/shm/infini-notebook-ab12-")
        assert shm_transport.new_segment(d, "push").path.startswith(d + "/push-")
    finally:
        shm_transport.remove_session_dirs("/tmp/infini-notebook-ab12")


def test_the_pickle_is_protocol_5(seg):
    packed = shm_transport.pack([np.ones(100_000)], seg)
    assert packed.data[:2] == pickle.PROTO + bytes([5]) and packed.spans
