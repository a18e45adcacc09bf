"""nccl-tests' arithmetic and tables, pure (no torch; pandas only inside the frame makers).

nccl-tests conventions, from its ``*GetCollByteCount`` / ``*GetBw`` functions:
``size`` is max(send, receive) bytes of one rank; ``count`` is the elements argument of the
collective; for all_gather, reduce_scatter and all_to_all the per-rank count is the requested
count / n, rounded down to 16 bytes; time is the mean per iteration after warm-up, averaged
over the group's ranks; algbw = size / time (1 GB = 1e9 B); busbw = algbw x factor.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .errors import DistUsageError
from .ranks import format_ranks

if TYPE_CHECKING:
    import pandas as pd

COLLECTIVES: tuple[str, ...] = (
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
    "send_recv",
)  # fmt: skip
# Collectives that split the buffer in n equal blocks (nccl-tests' per-rank count).
SPLIT = frozenset({"all_gather", "reduce_scatter", "all_to_all"})
COLUMNS: tuple[str, ...] = (
    "collective", "group", "ranks", "group_size", "size_bytes", "count", "dtype", "time_us",
    "algbw_gbps", "busbw_gbps",
)  # fmt: skip
# canonical torch name -> element size; aliases include nccl-tests' type names
DTYPES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int8": 1, "uint8": 1, "int32": 4, "int64": 8,
}  # fmt: skip
DTYPE_ALIASES: dict[str, str] = {
    "float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16",
    "bf16": "bfloat16", "double": "float64", "fp64": "float64", "int": "int32",
    "long": "int64", "char": "int8",
}  # fmt: skip
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}  # nccl-tests: K = 1024
GB = 1e9


# --------------------------------------------------------------------------- pure part


def parse_size(text: str | int) -> int:
    """``"4K"`` -> 4096, ``"1G"`` -> 2**30, ``"512"`` -> 512 (K, M, G are powers of 1024)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)(?:i?[bB])?\s*", str(text))
        if m is None:
            raise DistUsageError(
                f"Bad size {text!r}: use bytes with an optional K, M or G suffix, like 4K or 1G."
            )
        value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value < 1:
        raise DistUsageError(f"Size {text!r} is below one byte: use sizes like 1K or 4M.")
    return value


def parse_sizes(text: str | int | Sequence[int | str], factor: float = 2.0) -> list[int]:
    """``"4K:1G"`` -> [4096, 8192, ..., 2**30], each ``factor`` times the previous (as
    nccl-tests' -b/-e/-f); ``"1M"`` -> [1048576]; a list is taken as the sizes themselves."""
    if isinstance(text, (list, tuple)):
        return sorted({parse_size(s) for s in text})
    lo_text, sep, hi_text = str(text).partition(":")
    lo = parse_size(lo_text)
    hi = parse_size(hi_text) if sep else lo
    if hi < lo:
        raise DistUsageError(f"Sizes {text!r} go down: write MIN:MAX with MIN <= MAX, like 4K:1G.")
    if not factor > 1:
        raise DistUsageError(f"--factor {factor} must be above 1 (2 doubles the size each step).")
    sizes = [lo]
    while True:
        nxt = max(sizes[-1] + 1, int(sizes[-1] * factor))  # always move, even for factor ~1
        if nxt > hi:
            return sizes
        sizes.append(nxt)


def resolve_dtype(name: str) -> str:
    """Canonical torch dtype name for ``name`` (``float``, ``bf16``, ``half`` ...)."""
    key = str(name).lower().removeprefix("torch.")
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise DistUsageError(
            f"Unknown dtype {name!r}: use one of {', '.join(DTYPES)} (or float, half, bf16)."
        )
    return key


def count_and_bytes(collective: str, size_bytes: int, itemsize: int, n: int) -> tuple[int, int]:
    """nccl-tests' (count, size) for a requested size on a group of ``n`` ranks.

    count: the collective's element count (per rank, per block for the split collectives);
    size: max(send, receive) bytes of one rank, the number the table and algbw use."""
    count = size_bytes // itemsize
    if collective in SPLIT:
        align = max(1, 16 // itemsize)  # nccl-tests rounds each rank's block down to 16 bytes
        per_rank = (count // n) // align * align
        return per_rank, per_rank * n * itemsize
    return count, count * itemsize


def bus_factor(collective: str, n: int) -> float:
    """busbw / algbw (nccl-tests' PERFORMANCE.md): the fraction of the data each link
    carries, so busbw compares with the hardware's peak whatever the group size."""
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in SPLIT:
        return (n - 1) / n
    if collective in ("broadcast", "reduce", "send_recv"):
        return 1.0
    raise DistUsageError(f"Unknown collective {collective!r}: use {', '.join(COLLECTIVES)}.")


def bandwidths(collective: str, size_bytes: int, time_s: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1 GB = 1e9 bytes) for ``size_bytes`` moved in ``time_s``."""
    algbw = size_bytes / GB / time_s if time_s > 0 else math.inf
    return algbw, algbw * bus_factor(collective, n)


def check_collectives(names: Iterable[str] | None) -> list[str]:
    names = list(names or ["all_reduce"])
    if names == ["all"]:
        return list(COLLECTIVES)
    bad = [c for c in names if c not in COLLECTIVES]
    if bad:
        hint = " (p2p is a mode of its own: %dist_bench p2p)" if "p2p" in bad else ""
        raise DistUsageError(
            f"Unknown collective {bad[0]!r}: use {', '.join(COLLECTIVES)} or all{hint}."
        )
    return list(dict.fromkeys(names))


def aggregate(step: dict, replies: dict[int, dict | None]) -> list[dict]:
    """Per-rank replies of one step -> one row per group (time averaged over its ranks,
    wrong elements summed, as nccl-tests does)."""
    by_group: dict[tuple[int, ...], list[dict]] = {}
    for _, reply in sorted(replies.items()):
        if reply:
            by_group.setdefault(tuple(reply["ranks"]), []).append(reply)
    rows = []
    for members, got in sorted(by_group.items()):
        n = len(members)
        count, size = count_and_bytes(step["collective"], step["size"], DTYPES[step["dtype"]], n)
        time_s = sum(r["time_s"] for r in got) / len(got)
        algbw, busbw = bandwidths(step["collective"], size, time_s, n)
        row = {
            "collective": step["collective"],
            "group": step["kind"],
            "ranks": members,
            "group_size": n,
            "size_bytes": size,
            "count": count,
            "dtype": step["dtype"],
            "time_us": time_s * 1e6,
            "algbw_gbps": algbw,
            "busbw_gbps": busbw,
        }
        if step["check"]:
            row["wrong"] = sum(int(r["wrong"] or 0) for r in got)
        rows.append(row)
    return rows


def to_frame(rows: list[dict], check: bool = False, **attrs: Any) -> pd.DataFrame:
    import pandas as pd

    columns = list(COLUMNS) + (["wrong"] if check else [])
    df = pd.DataFrame(rows, columns=columns)
    df.attrs.update(attrs)
    return df


def three_digits(gbps: float) -> str:
    """A bandwidth with 3 significant digits: 0.00381 and 12.3 (nccl-tests' fixed 2 decimals
    print the bandwidth of small messages on CPU ranks as 0.00), 483 above 100."""
    if gbps != gbps or gbps == 0:  # NaN, or nothing moved
        return f"{gbps:.0f}" if gbps == 0 else "nan"
    return f"{gbps:.0f}" if abs(gbps) >= 100 else f"{gbps:.3g}"


# column -> (heading, unit, width, format), as nccl-tests prints its table
TABLE: dict[str, tuple[str, str, int, Callable[[Any], str]]] = {
    "size_bytes": ("size", "(B)", 10, str),
    "count": ("count", "(elements)", 12, str),
    "dtype": ("type", "", 8, str),
    "ranks": ("ranks", "", 12, lambda ranks: format_ranks(list(ranks))),
    "time_us": ("time", "(us)", 9, "{:.1f}".format),
    "algbw_gbps": ("algbw", "(GB/s)", 8, three_digits),
    "busbw_gbps": ("busbw", "(GB/s)", 8, three_digits),
    "wrong": ("#wrong", "", 6, str),
}


def format_table(df: pd.DataFrame) -> str:
    """nccl-tests' table, one block per (collective, group kind), with its average busbw."""
    if df.empty:
        return "# no results"
    attrs = df.attrs
    lines: list[str] = [f"# {attrs['caveat']}"] if attrs.get("caveat") else []
    for (coll, kind), block in df.groupby(["collective", "group"], sort=False):
        lines.append(
            f"# {coll} on {groups_text(kind, block)}"
            + (f", {attrs['iters']} iters, {attrs['warmup']} warm-up" if "iters" in attrs else "")
            + (f", timer {attrs['timer']}" if attrs.get("timer") else "")
        )
        lines += _block_lines(block)
        lines.append(f"# Avg bus bandwidth    : {three_digits(block['busbw_gbps'].mean())} GB/s\n")
    return "\n".join(lines).rstrip("\n")


def groups_text(kind: str, block: pd.DataFrame) -> str:
    """'the world group of 4 ranks', '2 tp groups of 2 ranks' (all run at once)."""
    sizes = "/".join(map(str, sorted(set(block["group_size"]))))
    n = len({tuple(r) for r in block["ranks"]})
    return f"the {kind} group of {sizes} ranks" if n == 1 else f"{n} {kind} groups of {sizes} ranks"


def _block_lines(block: pd.DataFrame) -> list[str]:
    """Heading, units and one line per row, columns two spaces apart, headings after '# '."""
    import pandas as pd

    columns = [c for c in TABLE if c in block.columns]
    cells = pd.DataFrame(
        [[TABLE[c][0] for c in columns], [TABLE[c][1] for c in columns]]
        + [[TABLE[c][3](v) for c, v in zip(columns, row)] for row in block[columns].values],
        columns=columns,
    )
    # to_string puts one space before each column: width + 1, and + 2 before the first
    space = {c: TABLE[c][2] + 1 + (c == columns[0]) for c in columns}
    text = cells.to_string(index=False, header=False, col_space=space).split("\n")
    return ["# " + line[2:].rstrip() if i < 2 else line.rstrip() for i, line in enumerate(text)]


def p2p_frame(times: dict[tuple[int, int], list[float]], world: int, size: int) -> pd.DataFrame:
    """{(src, dst): [seconds per iteration, from src and dst]} -> src x dst GB/s matrix."""
    import numpy as np
    import pandas as pd

    bw = np.full((world, world), np.nan)
    for (s, d), ts in times.items():
        bw[s, d] = size / GB / (sum(ts) / len(ts))
    df = pd.DataFrame(bw, index=pd.Index(range(world), name="src"))
    df.columns = pd.Index(range(world), name="dst")
    df.attrs["size_bytes"] = size
    return df


def p2p_by_locality(matrix: pd.DataFrame, hosts: Sequence[str]) -> dict[str, float]:
    """Mean send bandwidth (GB/s) of intra-node and of inter-node pairs."""
    sums: dict[str, list[float]] = {"intra-node": [], "inter-node": []}
    for src in matrix.index:
        for dst in matrix.columns:
            value = matrix.loc[src, dst]
            if src != dst and value == value:  # skip the diagonal and NaN
                kind = "intra-node" if hosts[src] == hosts[dst] else "inter-node"
                sums[kind].append(float(value))
    return {k: sum(v) / len(v) for k, v in sums.items() if v}


def p2p_summary(matrix: pd.DataFrame, hosts: Sequence[str]) -> str:
    """The src x dst matrix, then the mean intra- and inter-node send bandwidth."""
    caveat = matrix.attrs.get("caveat")
    lines = ([caveat] if caveat else []) + [matrix.round(3).to_string()]
    for kind, gbps in p2p_by_locality(matrix, hosts).items():
        lines.append(f"mean {kind} send bandwidth: {gbps:.3f} GB/s")
    return "\n".join(lines)
