"""The parallel layout: pure rank math, no torch.

``ParallelLayout`` turns (world_size, tp, cp, pp, dp, order) into ranks, coordinates and groups
from one index grid, picotron's ``arange(world).view(...)`` idea driven by Megatron's order
string. It imports no torch and is cheap enough to plan 65,536-rank jobs; ``groups`` builds
the torch process groups from it.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from numbers import Integral
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy stays out of the import path until a grid is needed
    import numpy as np

DIMS: tuple[str, ...] = ("tp", "cp", "dp", "pp")
DEFAULT_ORDER = "tp-cp-dp-pp"
ENV_SIZES = {"tp": "TP_SIZE", "cp": "CP_SIZE", "pp": "PP_SIZE", "dp": "DP_SIZE"}


@dataclass(frozen=True)
class ParallelLayout:
    """How ``world_size`` ranks split into tp x cp x dp x pp; ``order`` is fastest dim first."""

    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int | None = None
    order: str = DEFAULT_ORDER
    zero1: int | None = None
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "cp", "pp"):
            _check_int(name, getattr(self, name))
        if self.dp is None:
            rest = self.tp * self.cp * self.pp
            if self.world_size % rest:
                raise ValueError(
                    f"world_size {self.world_size} is not divisible by tp {self.tp} x cp "
                    f"{self.cp} x pp {self.pp} = {rest}, so dp cannot be inferred; pick sizes "
                    f"whose product divides {self.world_size}."
                )
            object.__setattr__(self, "dp", self.world_size // rest)
        _check_int("dp", self.dp)
        product = self.tp * self.cp * self.dp * self.pp
        if product != self.world_size:
            raise ValueError(
                f"tp {self.tp} x cp {self.cp} x dp {self.dp} x pp {self.pp} = {product}, but "
                f"world_size is {self.world_size}; make the product equal world_size "
                "(or leave dp unset to infer it)."
            )
        dims = tuple(self.order.split("-")) if isinstance(self.order, str) else ()
        if sorted(dims) != sorted(DIMS):
            raise ValueError(
                f"order {self.order!r} must list tp, cp, dp, pp once each, fastest first "
                f"(e.g. {DEFAULT_ORDER!r} or 'tp-cp-pp-dp'); sizes tp {self.tp} x cp {self.cp}"
                f" x dp {self.dp} x pp {self.pp} = {product}, world_size {self.world_size}."
            )
        if self.zero1 is not None:
            _check_int("zero1", self.zero1)
            if self.dp % self.zero1:
                raise ValueError(
                    f"zero1={self.zero1} must divide dp={self.dp} (ZeRO-1 shards each dp group "
                    f"into chunks of zero1 consecutive ranks); world_size {self.world_size} = "
                    f"tp {self.tp} x cp {self.cp} x dp {self.dp} x pp {self.pp}."
                )

    # ---- construction helpers

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParallelLayout:
        return cls(**dict(data))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    @classmethod
    def from_env(
        cls, world_size: int | None = None, env: Mapping[str, str] | None = None
    ) -> ParallelLayout:
        """Read WORLD_SIZE, TP_SIZE, CP_SIZE, PP_SIZE, DP_SIZE, PARALLEL_ORDER, ZERO1_SIZE."""
        env = os.environ if env is None else env
        if world_size is None:
            if "WORLD_SIZE" not in env:
                raise ValueError(
                    "WORLD_SIZE is not set; launch with torchrun, set WORLD_SIZE, or pass "
                    "a ParallelLayout explicitly."
                )
            world_size = _env_int(env, "WORLD_SIZE")
        sizes = {d: _env_int(env, var) for d, var in ENV_SIZES.items() if env.get(var)}
        zero1 = _env_int(env, "ZERO1_SIZE") if env.get("ZERO1_SIZE") else None
        order = env.get("PARALLEL_ORDER") or DEFAULT_ORDER
        return cls(world_size, order=order, zero1=zero1, **sizes)

    def to_env(self) -> dict[str, str]:
        """The variables ``from_env`` reads (not WORLD_SIZE, which torchrun sets), so a process
        that exports them and calls ``init_parallel_groups()`` gets this layout back."""
        env = {var: str(getattr(self, d)) for d, var in ENV_SIZES.items()}
        env["PARALLEL_ORDER"] = self.order
        env["ZERO1_SIZE"] = str(self.zero1) if self.zero1 is not None else ""
        return env

    # ---- sizes and coordinates

    @property
    def dims(self) -> tuple[str, ...]:
        """Dims fastest-changing first, as in ``order``."""
        return tuple(self.order.split("-"))

    @property
    def sizes(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in DIMS}

    @property
    def active_dims(self) -> tuple[str, ...]:
        """Dims of size > 1, fastest first as in ``order``: the ones worth showing."""
        return tuple(d for d in self.dims if getattr(self, d) > 1)

    def _repr_html_(self) -> str:
        from ..viz.render import layout_html  # pure HTML: no widgets imported

        return layout_html(self)

    def sizes_text(self) -> str:
        """``tp 2 x dp 2 x pp 2``: the dims of size > 1 (``dp 1`` for one rank)."""
        used = sorted(self.active_dims, key=DIMS.index) or ["dp"]
        return " x ".join(f"{d} {getattr(self, d)}" for d in used)

    def describe(self) -> str:
        """``world 8 = tp 2 x dp 2 x pp 2 (order tp-cp-dp-pp)``: dims of size 1 left out."""
        z = f", zero1 {self.zero1}" if self.zero1 else ""
        return f"world {self.world_size} = {self.sizes_text()} (order {self.order}{z})"

    @property
    def _grid(self) -> np.ndarray:
        """Rank grid with axes slowest dim first, so ``grid[coords] == rank``."""
        if "grid" not in self._cache:
            slow_first = self.dims[::-1]
            shape = tuple(getattr(self, d) for d in slow_first)
            self._cache["grid"] = _np().arange(self.world_size, dtype="int64").reshape(shape)
        return self._cache["grid"]

    def _axis(self, dim: str) -> int:
        return self.dims[::-1].index(dim)

    def coords(self, rank: int) -> dict[str, int]:
        self._check_rank(rank)
        out, rest = {}, rank
        for d in self.dims:  # fastest first: peel sizes off like digits
            out[d] = rest % getattr(self, d)
            rest //= getattr(self, d)
        return {d: out[d] for d in DIMS}

    def rank_of(self, **coords: int) -> int:
        self._check_coords(coords, need_all=True)
        rank, stride = 0, 1
        for d in self.dims:
            rank += coords[d] * stride
            stride *= getattr(self, d)
        return rank

    def ranks_where(self, **coords: int) -> list[int]:
        """Ranks whose coordinates match every given one, e.g. ``ranks_where(pp=0, tp=1)``."""
        self._check_coords(coords, need_all=False)
        index = tuple(coords.get(d, slice(None)) for d in self.dims[::-1])
        return _np().asarray(self._grid[index]).reshape(-1).tolist()

    # ---- groups

    def kinds(self) -> list[str]:
        """Every group kind: each non-empty combination of dims, in ``order``."""
        return ["-".join(c) for n in range(1, 5) for c in itertools.combinations(self.dims, n)]

    def normalize_kind(self, kind: str) -> str:
        """``"dp-cp"`` -> ``"cp-dp"`` (dims in layout order); ``"world"`` is all four dims."""
        if kind == "world":
            return "-".join(self.dims)
        parts = kind.split("-") if isinstance(kind, str) else []
        bad = [p for p in parts if p not in DIMS]
        if not parts or bad or len(set(parts)) != len(parts):
            raise ValueError(
                f"unknown group kind {kind!r}: use dims from {', '.join(DIMS)} joined by '-' "
                f"(e.g. 'tp', 'cp-dp', 'tp-pp'), each at most once, or 'world'."
            )
        return "-".join(d for d in self.dims if d in parts)

    def kind_label(self, kind: str) -> str:
        """A kind as users read it: ``"world"`` for the group of all ranks (``"world"``
        normalizes to all four dims, which "tp-cp-dp-pp group 0" said badly), else the kind
        in layout order."""
        return kind_label(self.normalize_kind(kind))

    def kind_size(self, kind: str) -> int:
        return math.prod([getattr(self, d) for d in self.normalize_kind(kind).split("-")])

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of ``kind``: ranks that differ only in the kind's dims, ascending."""
        kind = self.normalize_kind(kind)
        key = ("groups", kind)
        if key not in self._cache:
            self._cache[key] = self._group_array(kind).tolist()
        return self._cache[key]

    def group_of(self, rank: int, kind: str) -> list[int]:
        kind = self.normalize_kind(kind)
        if ("groups", kind) in self._cache:
            return self._cache[("groups", kind)][self._group_index(rank, kind)]
        fixed = {d: c for d, c in self.coords(rank).items() if d not in kind.split("-")}
        return self.ranks_where(**fixed)

    def _group_array(self, kind: str) -> np.ndarray:
        inside = set(kind.split("-"))
        slow_first = self.dims[::-1]
        outer = [self._axis(d) for d in slow_first if d not in inside]
        inner = [self._axis(d) for d in slow_first if d in inside]
        n = math.prod(getattr(self, d) for d in inside)
        return self._grid.transpose(outer + inner).reshape(-1, n)

    def _group_index(self, rank: int, kind: str) -> int:
        """Position of ``rank``'s group in ``groups(kind)``: its outer coords, row-major."""
        c = self.coords(rank)
        index = 0
        for d in self.dims[::-1]:
            if d not in kind.split("-"):
                index = index * getattr(self, d) + c[d]
        return index

    # ---- pipeline, context-parallel ring, ZeRO-1

    def pp_neighbours(self, rank: int) -> tuple[int | None, int | None]:
        """(previous stage, next stage) in ``rank``'s pp group; None at the ends."""
        group, i = self.group_of(rank, "pp"), self.coords(rank)["pp"]
        return (group[i - 1] if i > 0 else None, group[i + 1] if i + 1 < len(group) else None)

    def cp_ring(self, rank: int) -> tuple[int, int]:
        """(send to, receive from) around ``rank``'s cp group, as picotron's ring attention."""
        group, i = self.group_of(rank, "cp"), self.coords(rank)["cp"]
        return group[(i + 1) % len(group)], group[(i - 1) % len(group)]

    def zero1_groups(self) -> list[list[int]]:
        """Each dp group cut into consecutive chunks of ``zero1`` ranks (InternLM's rule)."""
        n = self._zero1_size()
        return [g[i : i + n] for g in self.groups("dp") for i in range(0, len(g), n)]

    def zero1_group_of(self, rank: int) -> list[int]:
        n, group = self._zero1_size(), self.group_of(rank, "dp")
        start = group.index(rank) // n * n
        return group[start : start + n]

    def _zero1_size(self) -> int:
        if self.zero1 is None:
            raise ValueError("this layout has no ZeRO-1 groups; pass zero1=N (N divides dp).")
        return self.zero1

    # ---- validation

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, Integral) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank {rank!r} is out of range: valid ranks are 0..{self.world_size - 1}."
            )

    def _check_coords(self, coords: Mapping[str, int], need_all: bool) -> None:
        valid = ", ".join(f"{d} 0..{getattr(self, d) - 1}" for d in DIMS)
        bad = [k for k in coords if k not in DIMS]
        if bad:
            raise ValueError(f"unknown dim {bad[0]!r}: valid dims and ranges are {valid}.")
        missing = [d for d in DIMS if d not in coords] if need_all else []
        if missing:
            raise ValueError(f"missing {', '.join(missing)}: give every dim ({valid}).")
        for d, c in coords.items():
            if not isinstance(c, Integral) or not 0 <= c < getattr(self, d):
                raise ValueError(f"{d}={c!r} is out of range: valid dims and ranges are {valid}.")


def kind_label(kind: str) -> str:
    """``"world"`` for a kind made of all four dims (whatever their order: every rank), else
    ``kind`` as given. For labels only; ``ParallelLayout.normalize_kind`` reads both."""
    return "world" if sorted(kind.split("-")) == sorted(DIMS) else kind


def _np():
    import numpy  # lazily: the layout's scalar math needs none, importing it costs ~0.1 s

    return numpy


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def _env_int(env: Mapping[str, str], var: str) -> int:
    try:
        return int(env[var])
    except ValueError:
        raise ValueError(
            f"{var}={env[var]!r} is not an integer; set it to a size like 2."
        ) from None
