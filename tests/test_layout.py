"""ParallelLayout: pure rank math, pinned to the worked example, picotron and Megatron."""

from __future__ import annotations

import importlib.util
import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infini_notebook.groups import DIMS, ParallelLayout

LAYOUT_PY = Path(__file__).resolve().parents[1] / "infini_notebook" / "core" / "layout.py"


# ------------------------------------------------------------------ references (independent)


def picotron_grid(layout: ParallelLayout) -> np.ndarray:
    """picotron's process_group_manager: ``arange(world).view(dp, pp, cp, tp)``."""
    return np.arange(layout.world_size).reshape(layout.dp, layout.pp, layout.cp, layout.tp)


def picotron_groups(layout: ParallelLayout, rank: int) -> dict[str, list[int]]:
    grid = picotron_grid(layout)
    dp, pp, cp, tp = (int(i[0]) for i in np.nonzero(grid == rank))
    return {
        "tp": grid[dp, pp, cp, :].tolist(),
        "cp": grid[dp, pp, :, tp].tolist(),
        "pp": grid[dp, :, cp, tp].tolist(),
        "dp": grid[:, pp, cp, tp].tolist(),
        "cp-dp": sorted(grid[:, pp, :, tp].flatten().tolist()),
        "pp-dp": sorted(grid[:, :, cp, tp].flatten().tolist()),
        "coords": {"tp": tp, "cp": cp, "pp": pp, "dp": dp},
    }


def megatron_groups(layout: ParallelLayout, kind: str) -> list[list[int]]:
    """Megatron-LM's generate_masked_orthogonal_rank_groups, rewritten from its definition."""
    dims = layout.dims
    shape = [getattr(layout, d) for d in dims]
    mask = [d in kind.split("-") for d in dims]
    stride = [int(np.prod(shape[:i])) for i in range(len(shape))]

    def decompose(index: int, sizes: list[int]) -> list[int]:
        out = []
        for s in sizes:
            out.append(index % s)
            index //= s
        return out

    masked = [s for s, m in zip(shape, mask, strict=True) if m]
    unmasked = [s for s, m in zip(shape, mask, strict=True) if not m]
    m_stride = [d for d, m in zip(stride, mask, strict=True) if m]
    u_stride = [d for d, m in zip(stride, mask, strict=True) if not m]
    size = int(np.prod(masked))
    groups = []
    for g in range(layout.world_size // size):
        base = sum(i * d for i, d in zip(decompose(g, unmasked), u_stride, strict=True))
        groups.append(
            [
                base + sum(i * d for i, d in zip(decompose(r, masked), m_stride, strict=True))
                for r in range(size)
            ]
        )
    return groups


# ------------------------------------------------------------------ strategies

sizes = st.sampled_from([1, 2, 3, 4])
orders = st.permutations(list(DIMS)).map("-".join)


@st.composite
def layouts(draw) -> ParallelLayout:
    tp, cp, pp, dp = draw(sizes), draw(sizes), draw(sizes), draw(sizes)
    divisors = [n for n in range(1, dp + 1) if dp % n == 0]
    zero1 = draw(st.one_of(st.none(), st.sampled_from(divisors)))
    return ParallelLayout(tp * cp * pp * dp, tp=tp, cp=cp, pp=pp, order=draw(orders), zero1=zero1)


def kinds_of(layout: ParallelLayout) -> list[str]:
    return layout.kinds()


# ------------------------------------------------------------------ worked example


def test_worked_example_default_order():
    layout = ParallelLayout(8, tp=2, pp=2)
    assert layout.dp == 2 and layout.cp == 1
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("tp-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.groups("cp") == [[r] for r in range(8)]
    assert layout.describe() == "world 8 = tp 2 x dp 2 x pp 2 (order tp-cp-dp-pp)"
    assert ParallelLayout(1).describe() == "world 1 = dp 1 (order tp-cp-dp-pp)"


def test_active_dims_are_the_dims_of_size_above_one_in_layout_order():
    assert ParallelLayout(8, tp=2, pp=2).active_dims == ("tp", "dp", "pp")
    layout = ParallelLayout(8, tp=2, pp=4, order="pp-cp-dp-tp")
    assert layout.active_dims == ("pp", "tp")
    assert layout.describe() == "world 8 = tp 2 x pp 4 (order pp-cp-dp-tp)"  # dims in DIMS order
    assert ParallelLayout(1).active_dims == ()


def test_worked_example_picotron_order():
    layout = ParallelLayout(8, tp=2, pp=2, order="tp-cp-pp-dp")
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_coords_and_neighbours_example():
    layout = ParallelLayout(8, tp=2, pp=2)
    assert layout.coords(5) == {"tp": 1, "cp": 0, "dp": 0, "pp": 1}
    assert layout.rank_of(tp=1, cp=0, dp=0, pp=1) == 5
    assert layout.ranks_where(pp=0, tp=1) == [1, 3]
    assert layout.pp_neighbours(0) == (None, 4)
    assert layout.pp_neighbours(4) == (0, None)
    assert layout.cp_ring(3) == (3, 3)  # cp=1: the ring is the rank itself
    ring = ParallelLayout(8, cp=4, tp=2)
    assert ring.groups("cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert ring.cp_ring(6) == (0, 4)


def test_zero1_chunks_each_dp_group():
    layout = ParallelLayout(16, tp=2, zero1=4)  # dp 8
    assert layout.groups("dp")[0] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert layout.zero1_groups()[:2] == [[0, 2, 4, 6], [8, 10, 12, 14]]
    assert layout.zero1_group_of(10) == [8, 10, 12, 14]


# ------------------------------------------------------------------ properties


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_picotron_grid_under_tp_cp_pp_dp(layout: ParallelLayout):
    layout = ParallelLayout(**{**layout.to_dict(), "order": "tp-cp-pp-dp"})
    for rank in range(layout.world_size):
        ref = picotron_groups(layout, rank)
        assert layout.coords(rank) == {d: ref["coords"][d] for d in DIMS}
        for kind in ("tp", "cp", "pp", "dp", "cp-dp", "pp-dp"):
            assert layout.group_of(rank, kind) == ref[kind], (kind, rank)


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_matches_megatron_rank_generator(layout: ParallelLayout):
    for kind in layout.kinds():
        assert layout.groups(kind) == megatron_groups(layout, kind), kind


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_groups_partition_the_world(layout: ParallelLayout):
    for kind in layout.kinds():
        groups = layout.groups(kind)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(layout.world_size))
        assert all(len(g) == layout.kind_size(kind) and g == sorted(g) for g in groups)
        inside = set(kind.split("-"))
        for g in groups:
            outside = {tuple(v for d, v in layout.coords(r).items() if d not in inside) for r in g}
            assert len(outside) == 1  # members differ only in the kind's dims
            for r in g:
                assert layout.group_of(r, kind) == g


@settings(max_examples=200, deadline=None)
@given(layouts(), st.data())
def test_coords_round_trip_and_ranks_where(layout: ParallelLayout, data):
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert all(0 <= c[d] < layout.sizes[d] for d in DIMS)
        assert layout.rank_of(**c) == rank
    chosen = data.draw(st.lists(st.sampled_from(DIMS), unique=True, max_size=4))
    where = {d: data.draw(st.integers(0, layout.sizes[d] - 1)) for d in chosen}
    ranks = layout.ranks_where(**where)
    expected = [
        r
        for r in range(layout.world_size)
        if all(layout.coords(r)[d] == v for d, v in where.items())
    ]
    assert ranks == expected


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_neighbours_ring_zero1_and_round_trip(layout: ParallelLayout):
    assert ParallelLayout(**layout.to_dict()) == layout
    assert ParallelLayout.from_dict(layout.to_dict()) == layout
    for rank in range(layout.world_size):
        prev, nxt = layout.pp_neighbours(rank)
        assert (prev is None) == (layout.coords(rank)["pp"] == 0)
        assert (nxt is None) == (layout.coords(rank)["pp"] == layout.pp - 1)
        if nxt is not None:
            assert layout.pp_neighbours(nxt)[0] == rank
        send_to, recv_from = layout.cp_ring(rank)
        assert layout.cp_ring(send_to)[1] == rank and layout.cp_ring(recv_from)[0] == rank
    if layout.zero1:
        chunks = layout.zero1_groups()
        assert sorted(r for c in chunks for r in c) == list(range(layout.world_size))
        for c in chunks:
            dp_group = layout.group_of(c[0], "dp")
            start = dp_group.index(c[0])
            assert c == dp_group[start : start + layout.zero1] and start % layout.zero1 == 0


# ------------------------------------------------------------------ kinds and errors


def test_kinds_are_normalised_to_layout_order():
    layout = ParallelLayout(8, tp=2, pp=2)
    assert layout.normalize_kind("dp-cp") == "cp-dp"
    assert layout.normalize_kind("pp-dp") == "dp-pp"
    assert layout.groups("dp-pp") == layout.groups("pp-dp")
    assert layout.normalize_kind("world") == "tp-cp-dp-pp"
    # the group of all ranks is "world" to a user, however it was spelled
    labels = [layout.kind_label(k) for k in ("world", "pp-tp-dp-cp", "dp-cp", "tp")]
    assert labels == ["world", "world", "cp-dp", "tp"]
    assert len(layout.kinds()) == 15 and layout.kinds()[:4] == ["tp", "cp", "dp", "pp"]
    assert ParallelLayout(8, tp=2, pp=2, order="pp-dp-cp-tp").normalize_kind("tp-pp") == "pp-tp"
    for bad in ("xp", "tp-tp", "", "tp-"):
        with pytest.raises(ValueError, match="unknown group kind"):
            layout.groups(bad)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"world_size": 8, "tp": 3}, "not divisible by tp 3 x cp 1 x pp 1 = 3"),
        ({"world_size": 8, "tp": 2, "dp": 2}, "tp 2 x cp 1 x dp 2 x pp 1 = 4, but world_size is 8"),
        ({"world_size": 8, "tp": 0}, "tp must be a positive integer, got 0"),
        ({"world_size": -8}, "world_size must be a positive integer"),
        ({"world_size": 8, "dp": -8}, "dp must be a positive integer"),
        ({"world_size": 8, "order": "tp-cp-dp"}, r"order 'tp-cp-dp'.*= 8, world_size 8"),
        ({"world_size": 8, "order": "tp-tp-dp-pp"}, "must list tp, cp, dp, pp once each"),
        ({"world_size": 8, "tp": 2, "zero1": 3}, "zero1=3 must divide dp=4"),
    ],
)
def test_bad_sizes_say_what_is_wrong(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ParallelLayout(**kwargs)


def test_bad_coords_name_valid_ranges():
    layout = ParallelLayout(8, tp=2, pp=2)
    with pytest.raises(ValueError, match="valid dims and ranges are tp 0..1, cp 0..0"):
        layout.ranks_where(ep=0)
    with pytest.raises(ValueError, match="pp=2 is out of range"):
        layout.ranks_where(pp=2)
    with pytest.raises(ValueError, match="missing cp, dp"):
        layout.rank_of(tp=0, pp=0)
    with pytest.raises(ValueError, match="valid ranks are 0..7"):
        layout.coords(8)
    with pytest.raises(ValueError, match="no ZeRO-1 groups"):
        layout.zero1_groups()


def test_from_env():
    env = {"WORLD_SIZE": "8", "TP_SIZE": "2", "PP_SIZE": "2", "PARALLEL_ORDER": "tp-cp-pp-dp"}
    assert ParallelLayout.from_env(env=env) == ParallelLayout(8, tp=2, pp=2, order="tp-cp-pp-dp")
    assert ParallelLayout.from_env(env={"WORLD_SIZE": "4", "ZERO1_SIZE": "2"}).zero1 == 2
    assert ParallelLayout.from_env(world_size=4, env={}).dp == 4
    with pytest.raises(ValueError, match="WORLD_SIZE is not set"):
        ParallelLayout.from_env(env={})
    with pytest.raises(ValueError, match="TP_SIZE='two' is not an integer"):
        ParallelLayout.from_env(env={"WORLD_SIZE": "8", "TP_SIZE": "two"})


@pytest.mark.parametrize(
    "layout",
    [ParallelLayout(8, tp=2, pp=2, order="tp-cp-pp-dp"), ParallelLayout(16, cp=2, zero1=2)],
)
def test_to_env_is_what_from_env_reads(layout):
    env = {"WORLD_SIZE": str(layout.world_size), **layout.to_env()}
    assert ParallelLayout.from_env(env=env) == layout
    # a stale variable from the kernel's environment cannot leak into the layout
    assert ParallelLayout.from_env(env={"ZERO1_SIZE": "4", **env}).zero1 == layout.zero1


def test_layout_is_hashable_and_frozen():
    a, b = ParallelLayout(8, tp=2), ParallelLayout(8, tp=2, dp=4)
    a.groups("tp")  # the cache must not leak into equality or hashing
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(AttributeError):
        a.tp = 4  # type: ignore[misc]


# ------------------------------------------------------------------ big worlds and imports
# How fast is benchmarks/bench_groups.py's to say; here only that the answers are right.


def test_65536_ranks_every_group_of_every_kind():
    layout = ParallelLayout(65536, tp=8, cp=2, pp=8)
    for kind in layout.kinds():
        groups = layout.groups(kind)
        assert len(groups) == 65536 // layout.kind_size(kind)
        assert sorted(r for g in groups for r in g) == list(range(65536))


def test_layout_module_imports_without_torch_or_numpy():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('layout_alone', {str(LAYOUT_PY)!r})\n"
        "mod = importlib.util.module_from_spec(spec); sys.modules['layout_alone'] = mod\n"
        "spec.loader.exec_module(mod)\n"
        "print('torch' in sys.modules, 'numpy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_all_kinds_listed_once():
    layout = ParallelLayout(16, tp=2, cp=2, pp=2)
    kinds = layout.kinds()
    assert len(set(kinds)) == 15
    expected = {"-".join(c) for n in range(1, 5) for c in itertools.combinations(layout.dims, n)}
    assert set(kinds) == expected


def test_groups_module_importable_by_spec():
    assert importlib.util.find_spec("infini_notebook.groups") is not None
