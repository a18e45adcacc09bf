"""Pull and push through shared memory, for ranks on the kernel's host.

A value is pickled once (protocol 5). Its large buffers (a tensor's bytes, a numpy array's,
any ``PickleBuffer``) go into one file in /dev/shm; only the small pickle, with each buffer's
offset and size in the file (``Packed``), travels through ipyparallel. The reader maps the
file copy-on-write (MAP_PRIVATE): tensors and arrays are built on the mapping without a copy,
no rank sees another's writes, and the file can be unlinked as soon as it is mapped (the
mapping stays valid). Files are named after the session's folder, so ``Session.stop`` and the
watchdog remove a session's files, and only those (``watchdog.remove_shared_files``).

Used on both sides: importing it stays cheap and torch-free (see ``engine``).
"""

from __future__ import annotations

import functools
import io
import mmap
import os
import pickle
import secrets
import sys
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


class NoRoom(OSError):
    """/dev/shm has too little free space for this transfer: it takes the ordinary path."""


# ----- pure helpers ---------------------------------------------------------------------------


def file_prefix(workdir: str, shm_dir: str = SHM_DIR) -> str:
    """Where a session's files start: /dev/shm/<its folder's basename>. Every name after it
    starts with "-", and a folder's basename has none after FOLDER_PREFIX (mkdtemp's random
    part), so one session's files never match another's prefix."""
    return os.path.join(shm_dir, os.path.basename(os.path.normpath(workdir)))


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


def pack(value: Any, path: str, *, create: bool, min_bytes: int = MIN_BYTES) -> Packed:
    """Pickle ``value``, its large buffers written into ``path`` (made here with ``create``,
    else it must exist: the kernel makes a pull's files). No file is touched when nothing is
    large. Raises what pickle raises, OSError (the file cannot be written) and NoRoom."""
    out = io.BytesIO()
    pickler = _Pickler(out, min_bytes)
    pickler.dump(value)
    spans = spans_for([b.nbytes for b in pickler.buffers])
    packed = Packed(out.getvalue(), spans)
    if spans:
        _write(path, pickler.buffers, spans, create)
    return packed


def unpack(packed: Packed, path: str | None) -> Any:
    """The value ``pack`` wrote, its buffers on a private mapping of ``path``."""
    if not packed.spans:
        return pickle.loads(packed.data)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < packed.size:  # reading past the end would SIGBUS
            raise OSError(f"{path} is shorter than the {packed.size} bytes it should hold")
        mapping = mmap.mmap(f.fileno(), packed.size, access=mmap.ACCESS_COPY)
    view = memoryview(mapping)  # tensors and arrays keep the mapping alive
    return pickle.loads(packed.data, buffers=[view[o : o + n] for o, n in packed.spans])


def _write(path: str, buffers: list[memoryview], spans, create: bool) -> None:
    _check_room(spans[-1][0] + spans[-1][1])
    flags = os.O_WRONLY | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
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


def new_path(workdir: str, what: str) -> str:
    """A fresh file name of this session for one transfer (``what``: push, pull)."""
    return f"{file_prefix(workdir)}-{what}-{secrets.token_hex(8)}"


def usable() -> bool:
    """Shared memory is on: /dev/shm exists and we may write there."""
    return enabled and os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def pack_or_none(value: Any, path: str) -> Packed | None:
    """``pack`` into a new file, or None when it cannot go that way (the caller then takes
    ipyparallel's path, which raises its own error for a value nobody can pickle)."""
    try:
        return pack(value, path, create=True)
    except Exception:
        remove([path])
        return None


def pack_or_value(value: Any, path: str) -> Packed | Any:
    """For a pull: ``pack`` into the kernel's file, or the value itself (ipyparallel's path)
    when it is code, cannot be pickled here, finds no file (this engine sees another
    /dev/shm) or no room."""
    if travels_as_code(value):
        return value
    try:
        return pack(value, path, create=False)
    except Exception:
        return value


def received(reply: Any, path: str | None) -> Any:
    """A pulled value: unpacked from its file, or as ipyparallel brought it."""
    return unpack(reply, path) if isinstance(reply, Packed) else reply


def make_files(workdir: str, what: str, keys) -> dict:
    """An empty file per key, made here, so that an engine writes only into a file that
    exists: one made after the kernel gave up and removed it would be left behind."""
    paths = {}
    try:
        for key in keys:
            path = f"{new_path(workdir, what)}-{key}"
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            paths[key] = path
    except OSError:  # /dev/shm out of inodes, say: the ordinary path for all
        remove(paths.values())
        return {}
    except BaseException:
        remove(paths.values())
        raise
    return paths


def remove(paths) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass
