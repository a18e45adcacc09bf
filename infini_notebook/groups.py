"""The torch process groups of a parallel layout, built on every rank.

``ParallelLayout`` (the pure rank math) lives in ``layout`` and is re-exported here.

``init_parallel_groups`` builds the groups on every rank after ``dist.init_process_group``,
economically: one creation call per distinct group kind and rank (``split_group`` where NCCL
can split, else a member-only ``new_group``), never one call per group per rank as
``new_subgroups_by_enumeration`` or ``init_device_mesh`` do on gloo; the ``DeviceMesh`` is then
assembled from those groups with ``DeviceMesh.from_group``, which creates nothing.

Kinds whose groups are equal share one group (cp=1 makes "cp-dp" the dp group), a kind spanning
the world is the default group, and kinds of size 1 open no communicator each: they share one
self group per rank, created by the rank alone, because DeviceMesh needs a group for every dim.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any

from .c10d import can_split, covers_world, group_timeout, pg_names, same_everywhere
from .core.layout import DEFAULT_ORDER, DIMS, ENV_SIZES, ParallelLayout
from .core.ranks import format_ranks

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "DEFAULT_KINDS", "DEFAULT_ORDER", "DIMS", "ENV_SIZES", "ParallelGroups", "ParallelLayout",
    "group_timeout", "init_parallel_groups",
]  # fmt: skip

log = logging.getLogger("infini_notebook")

# Built at init: the four dims and the combinations Megatron/picotron/InternLM use.
DEFAULT_KINDS: tuple[str, ...] = (
    "tp", "cp", "dp", "pp", "cp-dp", "pp-dp", "tp-pp", "tp-cp", "tp-dp",
)  # fmt: skip


# --------------------------------------------------------------------------- torch groups


class ParallelGroups:
    """This rank's process groups for a layout; build it with ``init_parallel_groups``.

    Group creation is collective: every rank calls the same methods in the same order
    (``get`` of a kind not built at init, ``get_group``), as with ``dist.new_group``.
    """

    def __init__(
        self, layout: ParallelLayout, *, cpu: bool = False, timeout: timedelta | None = None
    ) -> None:
        import torch.distributed as dist

        if layout.world_size != dist.get_world_size():
            raise ValueError(
                f"layout has world_size {layout.world_size} but the process group has "
                f"{dist.get_world_size()} ranks; build the layout with world_size="
                f"{dist.get_world_size()} ({layout.describe()})."
            )
        self.layout = layout
        self.rank = dist.get_rank()
        self.coords = layout.coords(self.rank)
        self.backend = str(dist.get_backend())
        self.device_type = "cuda" if "nccl" in self.backend else "cpu"
        self.creation_calls = 0
        self.how: dict[str, str] = {}  # kind -> how its group was obtained, for repr/bench
        self._world_pg = dist.group.WORLD
        self._lock = threading.RLock()
        self._by_kind: dict[str, Any] = {}
        self._by_ranks: dict[frozenset[int], Any] = {}  # None: known group, not a member
        self._created: list[Any] = []
        self._cpu_twins: dict[frozenset[int], Any] = {}
        self._cpu = cpu
        self.timeout = timeout  # every group's collective timeout; None: torch's default
        self._local_ok = False  # member-only creation allowed (set during a symmetric init)
        self._mode = "split" if can_split() else "new_group"

    # ---- public accessors

    def get(self, kind: str) -> ProcessGroup:
        """This rank's group of ``kind`` ("tp", "cp-dp", ...); collective if not built yet."""
        kind = self.layout.normalize_kind(kind)
        with self._lock:
            if kind not in self._by_kind:
                partition = self.layout.groups(kind)
                self._by_kind[kind] = self._obtain(kind, partition)
            return self._by_kind[kind]

    def get_group(self, ranks: Iterable[int]) -> ProcessGroup | None:
        """An ad-hoc group of global ``ranks`` from the same registry; None on non-members.

        Call it on every rank (like ``dist.new_group``); a rank set already built is reused.
        """
        ranks = sorted({int(r) for r in ranks})
        for r in ranks:
            self.layout._check_rank(r)
        key = frozenset(ranks)
        with self._lock:
            if key not in self._by_ranks:
                self._obtain(f"ranks {format_ranks(ranks)}", [ranks], whole_partition=False)
            return self._by_ranks[key]

    def cpu_group(self, kind: str) -> ProcessGroup:
        """Gloo twin of ``get(kind)`` for CPU tensors and control traffic: built at init with
        ``cpu=True``, else on first use (collective, like ``get``), then kept."""
        pg = self.get(kind)
        if self.backend == "gloo":
            return pg
        with self._lock:
            key = frozenset(self.layout.group_of(self.rank, kind))
            if key not in self._cpu_twins:
                self._cpu_twins[key] = self._new_gloo_twin(kind, sorted(key))
            return self._cpu_twins[key]

    @property
    def world(self) -> ProcessGroup:
        return self._world_pg

    tp = property(lambda self: self.get("tp"))
    cp = property(lambda self: self.get("cp"))
    dp = property(lambda self: self.get("dp"))
    pp = property(lambda self: self.get("pp"))
    tp_rank = property(lambda self: self.coords["tp"])
    cp_rank = property(lambda self: self.coords["cp"])
    dp_rank = property(lambda self: self.coords["dp"])
    pp_rank = property(lambda self: self.coords["pp"])
    tp_size = property(lambda self: self.layout.tp)
    cp_size = property(lambda self: self.layout.cp)
    dp_size = property(lambda self: self.layout.dp)
    pp_size = property(lambda self: self.layout.pp)

    def rank_in(self, kind: str) -> int:
        """This rank's index in its group of ``kind``."""
        return self.layout.group_of(self.rank, kind).index(self.rank)

    def ranks_in(self, kind: str) -> list[int]:
        return self.layout.group_of(self.rank, kind)

    @property
    def pp_prev(self) -> int | None:
        return self.layout.pp_neighbours(self.rank)[0]

    @property
    def pp_next(self) -> int | None:
        return self.layout.pp_neighbours(self.rank)[1]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_prev is None

    @property
    def is_last_stage(self) -> bool:
        return self.pp_next is None

    @property
    def cp_send_to(self) -> int:
        return self.layout.cp_ring(self.rank)[0]

    @property
    def cp_recv_from(self) -> int:
        return self.layout.cp_ring(self.rank)[1]

    @property
    def zero1(self) -> ProcessGroup | None:
        """This rank's ZeRO-1 sharding group, or None when the layout sets no zero1."""
        if self.layout.zero1 is None:
            return None
        with self._lock:
            if "zero1" not in self._by_kind:
                self._by_kind["zero1"] = self._obtain("zero1", self.layout.zero1_groups())
            return self._by_kind["zero1"]

    @cached_property
    def mesh(self) -> DeviceMesh:
        """DeviceMesh over all four dims (slowest first), assembled from the built groups."""
        from torch.distributed.device_mesh import DeviceMesh

        names = self.layout.dims[::-1]
        with self._lock:
            groups = [self.get(d) for d in names]
            return DeviceMesh.from_group(
                groups, self.device_type, mesh=self.layout._grid.tolist(), mesh_dim_names=names
            )

    def destroy(self) -> None:
        """Destroy every group this object created (not the default group)."""
        import torch.distributed as dist

        with self._lock:
            for pg in reversed(self._created):
                try:
                    dist.destroy_process_group(pg)
                except Exception as exc:  # one stuck group must not keep the rest alive
                    log.warning("destroying %s failed: %s", pg, exc)
            if self._created:
                _DESTROYED_IN["world"] = self._world_pg
            self._created.clear()
            self._by_kind.clear()
            self._by_ranks.clear()
            self._cpu_twins.clear()
            self.__dict__.pop("mesh", None)
            _forget(self)

    def __repr__(self) -> str:
        lines = [f"ParallelGroups(rank {self.rank}, {self.layout.describe()}, {self.backend})"]
        for kind in self._by_kind:
            members = (
                self.layout.group_of(self.rank, kind)
                if kind != "zero1"
                else (self.layout.zero1_group_of(self.rank))
            )
            label = self.layout.kind_label(kind) if kind != "zero1" else kind
            lines.append(f"  {label:<12} {format_ranks(members):<24} {self.how.get(kind, '')}")
        lines.append(
            f"  pp prev/next {self.pp_prev}/{self.pp_next}, cp ring ->{self.cp_send_to}"
            f" <-{self.cp_recv_from}, creation calls {self.creation_calls}"
        )
        return "\n".join(lines)

    # ---- creation (collective; callers hold the lock)

    @classmethod
    def build(
        cls,
        layout: ParallelLayout,
        *,
        cpu: bool = False,
        kinds: Iterable[str] = DEFAULT_KINDS,
        timeout: timedelta | None = None,
    ) -> ParallelGroups:
        """Build a new set of groups (collective, no memo); ``init_parallel_groups`` memoizes."""
        groups = cls(layout, cpu=cpu, timeout=timeout)
        with groups._lock:
            groups._build(tuple(layout.normalize_kind(k) for k in kinds))
        return groups

    def _build(self, kinds: Iterable[str]) -> None:
        # Member-only new_group names groups by hash(ranks, len(pg_names)): consistent only when
        # every rank has made the same number of groups, and fresh only if none were destroyed
        # in this world (the count drops back, the name and its stale store keys come back).
        self._local_ok = (
            self._mode == "new_group"
            and _DESTROYED_IN.get("world") is not self._world_pg
            and same_everywhere(len(pg_names()))
        )
        try:
            for kind in kinds:
                self.get(kind)
            if self.layout.zero1 is not None:
                _ = self.zero1
            _ = self.mesh  # fetches the four dims, so a mesh never creates groups later
            if self._cpu and self.backend != "gloo":
                for kind in [k for k in self._by_kind if k != "zero1"]:
                    self.cpu_group(kind)
        finally:
            self._local_ok = False

    def _obtain(self, label: str, partition: list[list[int]], whole_partition: bool = True):
        """This rank's group among ``partition`` (disjoint rank lists): reuse or create."""
        import torch.distributed as dist

        mine = next((g for g in partition if self.rank in g), None)
        if mine is not None and len(mine) == dist.get_world_size():
            self.how[label] = "world (default group)"
            self._by_ranks.setdefault(frozenset(mine), self._world_pg)
            return self._world_pg
        if mine is not None and frozenset(mine) in self._by_ranks:
            self.how[label] = "shared"
            return self._by_ranks[frozenset(mine)]
        if mine is None and all(frozenset(g) in self._by_ranks for g in partition):
            return None
        pg = self._create(label, partition, mine, whole_partition)
        for g in partition:
            self._by_ranks.setdefault(frozenset(g), None)
        if mine is not None:
            self._by_ranks[frozenset(mine)] = pg
            self._created.append(pg)
        return pg

    def _create(self, label, partition, mine, whole_partition):
        import torch.distributed as dist

        desc = f"inb_{label.replace(' ', '_')}"
        if self._mode == "split" and whole_partition and covers_world(partition):
            self.creation_calls += 1
            self.how[label] = "split_group"
            return dist.split_group(split_ranks=partition, timeout=self.timeout, group_desc=desc)
        if self._local_ok and whole_partition:
            self.creation_calls += 1
            self.how[label] = "new_group (members only)" if len(mine) > 1 else "self group"
            return dist.new_group(
                mine, timeout=self.timeout, use_local_synchronization=True, group_desc=desc
            )
        pg = None
        for g in partition:  # torch's rule: every rank enters every group's creation
            self.creation_calls += 1
            made = dist.new_group(g, timeout=self.timeout, group_desc=desc)
            if self.rank in g:
                pg = made
        self.how[label] = f"new_group x{len(partition)}"
        return pg

    def _new_gloo_twin(self, kind: str, ranks: list[int]):
        import torch.distributed as dist

        if self._local_ok and len(ranks) < dist.get_world_size():
            self.creation_calls += 1
            pg = dist.new_group(
                ranks,
                backend="gloo",
                timeout=self.timeout,
                use_local_synchronization=True,
                group_desc=f"inb_cpu_{kind}",
            )
            self._created.append(pg)
            return pg
        mine = None
        for g in self.layout.groups(kind):  # every rank enters every group's creation
            self.creation_calls += 1
            made = dist.new_group(
                g, backend="gloo", timeout=self.timeout, group_desc=f"inb_cpu_{kind}"
            )
            if self.rank in g:
                mine = made
                self._created.append(made)
        return mine


_ACTIVE: dict[tuple, ParallelGroups] = {}
_DESTROYED_IN: dict[str, Any] = {}  # the default group in which destroy() ran, if any
_ACTIVE_LOCK = threading.Lock()


def init_parallel_groups(
    layout: ParallelLayout | Mapping[str, Any] | None = None,
    *,
    cpu: bool = False,
    kinds: Iterable[str] = DEFAULT_KINDS,
    timeout: timedelta | float | None = None,
) -> ParallelGroups:
    """Build this rank's groups and DeviceMesh; call on every rank after init_process_group.

    ``layout`` defaults to ``ParallelLayout.from_env`` (TP_SIZE, CP_SIZE, PP_SIZE, ...), so a
    torchrun script needs no arguments. ``kinds`` are built now; other kinds on first
    ``get``. ``cpu=True`` builds gloo twins (``cpu_group(kind)``) now when the backend is not gloo.
    ``timeout`` (a timedelta or seconds) is every group's collective timeout; it defaults to
    the default group's, as given to ``init_process_group``, where torch alone would give
    subgroups its own 10 or 30 minutes. Calling it again with the same arguments returns the
    same object.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call dist.init_process_group(...) on every "
            "rank first (torchrun sets the env it needs)."
        )
    if layout is None:
        layout = ParallelLayout.from_env(world_size=dist.get_world_size())
    elif isinstance(layout, Mapping):
        layout = ParallelLayout.from_dict(layout)
    kinds = tuple(layout.normalize_kind(k) for k in kinds)
    timeout = _as_timedelta(timeout) if timeout is not None else group_timeout()
    key = (layout, id(dist.group.WORLD), cpu, kinds, timeout)
    with _ACTIVE_LOCK:
        if key in _ACTIVE:
            return _ACTIVE[key]
        groups = ParallelGroups.build(layout, cpu=cpu, kinds=kinds, timeout=timeout)
        _ACTIVE[key] = groups
        log.info("parallel groups: %s, %d creation calls", layout.describe(), groups.creation_calls)
        return groups


def _forget(groups: ParallelGroups) -> None:
    with _ACTIVE_LOCK:
        for key, value in list(_ACTIVE.items()):
            if value is groups:
                del _ACTIVE[key]


def _as_timedelta(timeout: timedelta | float) -> timedelta:
    if isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a timedelta or positive seconds, got {timeout!r}.")
    return timedelta(seconds=timeout)
