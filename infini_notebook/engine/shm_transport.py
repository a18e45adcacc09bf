"""Pull and push through shared memory, for ranks on the kernel's host.

A value is pickled once (protocol 5). Its large buffers (a tensor's bytes, a numpy array's,
any ``PickleBuffer``) go into one file in /dev/shm; only the small pickle, with each buffer's
offset and size in the file (``Packed``), travels through ipyparallel. The reader maps the
file copy-on-write (MAP_PRIVATE): tensors and arrays are built on the mapping without a copy,
no rank sees another's writes, and the file can be unlinked as soon as it is mapped (the
mapping stays valid).

Only the kernel makes files, in the session's own folder in /dev/shm (mode 0700, a fresh
random name after the session folder's: ``make_dir``), and it records what each file is
(``Segment``: device, inode, owner, mode). A rank opens a file without following a link and
never creates one, and uses it only if it is still that file (``open_segment``): a rank whose
call was still queued when the kernel gave up on a transfer and removed its files neither
writes a pulled value into, nor reads pushed values from, a file someone made after. Once the
session ends, ``remove_session_dirs`` removes its folder, and only that (the watchdog too).

Used on both sides: importing it stays cheap and torch-free (see ``engine``).
"""

from __future__ import annotations

import functools
import io
import mmap
import os
import pickle
import secrets
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass
from types import FunctionType
from typing import Any

SHM_DIR = "/dev/shm"
MIN_BYTES = 64 * 1024  # a smaller buffer stays in the pickle: a copy costs less than a region
ALIGN = 64  # each buffer starts on a cache line, so a tensor of any dtype is aligned
# A transfer may take at most this part of /dev/shm's free space: NCCL and DataLoader workers
# need it too, and data on a mapping keeps counting there for as long as it lives.
ROOM = 0.5
enabled = True  # False: every pull and push takes ipyparallel's stream (benchmarks, tests)


@dataclass(frozen=True)
class Packed:
    """What travels through ipyparallel: the pickle, and where its out-of-band buffers lie
    in the file (offset and size of each, in the order pickle asks for them)."""

    data: bytes
    spans: tuple[tuple[int, int], ...] = ()

    @property
    def size(self) -> int:
        return self.spans[-1][0] + self.spans[-1][1] if self.spans else 0


@dataclass(frozen=True)
class Segment:
    """One transfer's file as the kernel made it: its path, and what the file there must be
    when a rank opens it. Anything else at that path is another file, made after the kernel
    removed its own."""

    path: str
    dev: int
    ino: int
    uid: int
    mode: int


class NoRoom(OSError):
    """/dev/shm has too little free space for this transfer: it takes the ordinary path."""


class ForeignFile(OSError):
    """The file at a segment's path is not the one the kernel made: it is left alone."""


# ----- pure helpers ---------------------------------------------------------------------------


def file_prefix(workdir: str, shm_dir: str = SHM_DIR) -> str:
    """Where the name of a session's folder in /dev/shm starts: /dev/shm/<its folder's
    basename>, then "-". A folder's basename has no "-" after FOLDER_PREFIX (mkdtemp's random
    part), so one session's prefix never matches another's folder."""
    return os.path.join(shm_dir, os.path.basename(os.path.normpath(workdir)))


def segment_problem(st: os.stat_result, segment: Segment) -> str | None:
    """Why the file with status ``st`` (fstat of what was opened at ``segment.path``) is
    not the kernel's, or None when it is."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if (st.st_dev, st.st_ino) != (segment.dev, segment.ino):
        return "is another file than the one the notebook made"
    if st.st_uid != segment.uid:
        return f"belongs to uid {st.st_uid}, not {segment.uid}"
    if stat.S_IMODE(st.st_mode) != segment.mode:
        return f"has mode {stat.S_IMODE(st.st_mode):o}, not {segment.mode:o}"
    return None


def own_dir_problem(st: os.stat_result, uid: int) -> str | None:
    """Why a folder with lstat ``st`` is not one this user made for a session (mode 0700),
    or None."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != uid:
        return f"belongs to uid {st.st_uid}"
    if stat.S_IMODE(st.st_mode) != 0o700:
        return f"has mode {stat.S_IMODE(st.st_mode):o}"
    return None


def spans_for(sizes: list[int], align: int = ALIGN) -> tuple[tuple[int, int], ...]:
    """(offset, size) of buffers laid one after another, each starting aligned."""
    spans, offset = [], 0
    for size in sizes:
        spans.append((offset, size))
        offset += -(-size // align) * align
    return tuple(spans)


def travels_as_code(value: Any) -> bool:
    """Values that ipyparallel sends as code (a function, a class defined in the notebook),
    which plain pickle would send by a name the other side may not have: they keep the
    ordinary path."""
    return isinstance(value, (FunctionType, functools.partial, type))


# ----- pickling with buffers in a file -----------------------------------------------------


class _Pickler(pickle.Pickler):
    """Protocol 5, tensors as PickleBuffers of their bytes, large buffers kept aside."""

    def __init__(self, file, min_bytes: int):
        super().__init__(file, protocol=5, buffer_callback=self._keep)
        self.buffers: list[memoryview] = []
        self._min_bytes = min_bytes
        self._tensor_types = _tensor_types()

    def _keep(self, buffer: pickle.PickleBuffer) -> bool:
        raw = buffer.raw()
        if raw.nbytes < self._min_bytes:
            return True  # in the pickle
        self.buffers.append(raw)
        return False

    def reducer_override(self, obj):
        if type(obj) in self._tensor_types:
            return _reduce_tensor(obj)
        return NotImplemented


def _tensor_types() -> tuple[type, ...]:
    torch = sys.modules.get("torch")  # no torch loaded: no tensor to meet
    return (torch.Tensor, torch.nn.Parameter) if torch is not None else ()


def _reduce_tensor(t):
    """A CPU tensor as its values' bytes (any dtype; a view sends only what it shows, as a
    contiguous tensor); anything else (GPU, sparse, quantized, named, with attributes) as
    torch pickles it."""
    import torch

    if (
        t.device.type != "cpu"
        or t.layout != torch.strided
        or t.is_quantized
        or t.is_nested
        or any(n is not None for n in getattr(t, "names", ()))  # gone in recent torch
        or t.__dict__
    ):
        return NotImplemented
    plain = t.detach().resolve_conj().resolve_neg().contiguous()
    data = plain.reshape(-1).view(torch.uint8).numpy()
    parameter = type(t) is torch.nn.Parameter
    return _tensor, (
        pickle.PickleBuffer(data),
        plain.dtype,
        tuple(plain.shape),
        t.requires_grad,
        parameter,
    )


def _tensor(buffer, dtype, shape: tuple, requires_grad: bool, parameter: bool):
    """A tensor on ``buffer`` (no copy): a writable mapping or the pickle's bytearray."""
    import torch

    if memoryview(buffer).nbytes:
        t = torch.frombuffer(buffer, dtype=dtype).view(shape)
    else:  # frombuffer refuses an empty buffer
        t = torch.empty(shape, dtype=dtype)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_() if requires_grad else t


def pack(value: Any, segment: Segment, min_bytes: int = MIN_BYTES) -> Packed:
    """Pickle ``value``, its large buffers written into ``segment`` (the kernel made it). No
    file is touched when nothing is large. Raises what pickle raises, OSError (the file
    cannot be written), ForeignFile and NoRoom."""
    out = io.BytesIO()
    pickler = _Pickler(out, min_bytes)
    pickler.dump(value)
    spans = spans_for([b.nbytes for b in pickler.buffers])
    packed = Packed(out.getvalue(), spans)
    if spans:
        _write(segment, pickler.buffers, spans)
    return packed


def unpack(packed: Packed, segment: Segment | None) -> Any:
    """The value ``pack`` wrote, its buffers on a private mapping of ``segment``."""
    if not packed.spans:
        return pickle.loads(packed.data)
    fd = open_segment(segment, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < packed.size:  # reading past the end would SIGBUS
            raise OSError(f"{segment.path} is shorter than the {packed.size} bytes it should hold")
        mapping = mmap.mmap(fd, packed.size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    view = memoryview(mapping)  # tensors and arrays keep the mapping alive
    return pickle.loads(packed.data, buffers=[view[o : o + n] for o, n in packed.spans])


def open_segment(segment: Segment, flags: int) -> int:
    """A descriptor of the kernel's file ``segment``: never made here, no link followed, and
    ForeignFile when what is at its path now is another file."""
    fd = os.open(segment.path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    problem = segment_problem(os.fstat(fd), segment)
    if problem:
        os.close(fd)
        raise ForeignFile(f"{segment.path} {problem}: not used")
    return fd


def _write(segment: Segment, buffers: list[memoryview], spans) -> None:
    _check_room(spans[-1][0] + spans[-1][1])
    fd = open_segment(segment, os.O_WRONLY)
    try:
        for raw, (offset, _) in zip(buffers, spans):
            _write_at(fd, raw, offset)
    except BaseException:
        os.ftruncate(fd, 0)  # give the space back now; the kernel removes the file
        raise
    finally:
        os.close(fd)


def _write_at(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):  # one write moves at most ~2 GiB
        done += os.pwrite(fd, data[done:], offset + done)


def _check_room(size: int) -> None:
    st = os.statvfs(SHM_DIR)
    if size > st.f_bavail * st.f_frsize * ROOM:
        raise NoRoom(f"{size} bytes do not fit in {SHM_DIR}")


# ----- the kernel's and the engines' steps -------------------------------------------------


def usable() -> bool:
    """Shared memory is on: /dev/shm exists and we may write there."""
    return enabled and os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def make_dir(workdir: str) -> str | None:
    """A new folder for the session's files (its folder's name, "-", a random part; mode
    0700, so nobody else can make a file there); None where /dev/shm cannot serve."""
    if not usable():
        return None
    prefix = os.path.basename(file_prefix(workdir)) + "-"
    try:
        return tempfile.mkdtemp(prefix=prefix, dir=SHM_DIR)
    except OSError:
        return None


def new_segment(shm_dir: str, name: str) -> Segment:
    """An empty file of the kernel's in the session's folder ``shm_dir``, and what it is."""
    path = os.path.join(shm_dir, f"{name}-{secrets.token_hex(8)}")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return Segment(path, st.st_dev, st.st_ino, st.st_uid, stat.S_IMODE(st.st_mode))


def make_segments(shm_dir: str | None, what: str, keys) -> dict:
    """An empty file per key (``what``: push, pull), made here, so that an engine writes
    only into a file the kernel made and still has; {} when none can be made (the ordinary
    path for all)."""
    segments = {}
    if shm_dir is None:
        return segments
    try:
        for key in keys:
            segments[key] = new_segment(shm_dir, f"{what}-{key}")
    except OSError:  # /dev/shm out of inodes, say
        remove(segments.values())
        return {}
    except BaseException:
        remove(segments.values())
        raise
    return segments


def pack_or_none(value: Any, segment: Segment) -> Packed | None:
    """``pack`` into the kernel's new file, or None when it cannot go that way (the caller
    then takes ipyparallel's path, which raises its own error for a value nobody can
    pickle)."""
    try:
        return pack(value, segment)
    except Exception:
        return None


def pack_or_value(value: Any, segment: Segment) -> Packed | Any:
    """For a pull: ``pack`` into the kernel's file, or the value itself (ipyparallel's path)
    when it is code, cannot be pickled here, finds no file of the kernel's (this engine sees
    another /dev/shm, or the kernel gave up and removed it) or no room."""
    if travels_as_code(value):
        return value
    try:
        return pack(value, segment)
    except Exception:
        return value


def received(reply: Any, segment: Segment | None) -> Any:
    """A pulled value: unpacked from its file, or as ipyparallel brought it."""
    return unpack(reply, segment) if isinstance(reply, Packed) else reply


def remove(segments) -> None:
    """Remove files (Segments or paths)."""
    for segment in segments:
        try:
            os.unlink(getattr(segment, "path", segment))
        except OSError:
            pass


def clear_dir(shm_dir: str | None) -> None:
    """Remove the files in the session's folder (it stays)."""
    if shm_dir is not None and os.path.isdir(shm_dir):
        remove(os.path.join(shm_dir, name) for name in os.listdir(shm_dir))


def remove_session_dirs(workdir: str) -> None:
    """The session's folders in /dev/shm, and nothing else: named after ``workdir``, folders
    (not links) of this user's with mode 0700."""
    import glob

    for path in glob.glob(glob.escape(file_prefix(workdir)) + "-*"):
        try:
            if own_dir_problem(os.lstat(path), os.geteuid()) is None:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass
