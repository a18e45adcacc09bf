"""A notebook's ``%%dist`` cells as a torchrun script (``%dist_export``). Pure: text in, text out.

The input is the kernel's input history (raw cells, numbered as ``In[n]``) with each cell's
outcome. The script starts the way a session's rank starts (``engine.torchrun_namespace``:
same names, same groups through ``init_parallel_groups``), then runs the ``%%dist`` cells of
the last session in order, ``--ranks``/``--where`` turned into ``if`` guards.

``%%dist_profile`` cells ran on the ranks too, and changed their state: they are exported as
the cell they profiled (with ``profile=True``, ``%dist_export --profile``, under
torch.profiler as they ran, each rank's trace written beside the script). A session's GPU
choice (``--gpus 4,5,6,7``, ``--gpus 0,0``) goes into the script as ``GPUS``: each rank sees
the GPUs and gets the device index its session rank had (``engine.torchrun.use_gpus``).

What is left out is said in the script (``# skipped`` comments) and in ``Export.skipped``:
cells that failed in the notebook (a rerun that worked is what the script should repeat; the
failed code stays in the script as comments), code that ran in the notebook's kernel rather
than on the ranks, magics with no script equivalent (``%dist_pull``, ``%dist_push`` ...), and
IPython-only lines inside a ``%%dist`` cell. ``--background`` cells run inline, and count as
succeeded (the magic returns before they end).

Flags are parsed by the magics' own parsers, passed in as functions, so this module needs
neither IPython nor torch. The only side effects are at the edges: each cell's outcome is
recorded by an IPython hook (``record_outcome``), and ``write_script`` checks the path and
writes the file.
"""

from __future__ import annotations

import ast
import os
import re
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import DistUsageError
from .layout import DEFAULT_ORDER, ParallelLayout
from .ranks import parse_ranks, parse_where


@dataclass(frozen=True)
class HistoryCell:
    """One executed cell: its ``In[n]`` number, raw source and outcome (None: unknown)."""

    number: int
    source: str
    ok: bool | None = True


# In[n] -> whether that cell succeeded (post_run_cell hook): %dist_export leaves failed cells out.
CELL_OUTCOMES: dict[int, bool] = {}


def record_outcome(result) -> None:
    if result.execution_count is not None:
        CELL_OUTCOMES[result.execution_count] = bool(result.success)


def history(raw: Sequence[str]) -> list[HistoryCell]:
    """The kernel's raw input history (``In``; In[0] is empty) with each cell's outcome."""
    return [HistoryCell(n, raw[n], CELL_OUTCOMES.get(n)) for n in range(1, len(raw))]


@dataclass(frozen=True)
class Settings:
    """What the script needs from the session: layout, backend, collective timeout (s), and
    each rank's GPU (its CUDA_VISIBLE_DEVICES entry, SessionPlan.gpus; empty: CPU ranks, or
    ranks whose host picked their GPU)."""

    layout: ParallelLayout
    backend: str
    timeout: float = 300.0
    gpus: tuple[str, ...] = ()


@dataclass
class Export:
    text: str  # the script
    world_size: int  # torchrun's --nproc_per_node (x --nnodes)
    cells: list[int] = field(default_factory=list)  # In[n] of the %%dist cells it runs
    skipped: list[str] = field(default_factory=list)  # "In[n]: what (why)", one per line
    shows_values: bool = False  # a cell ends in an expression: the script defines show()
    profiled: bool = False  # a cell runs under torch.profiler: the script imports profiled()
    filename: str = "script.py"  # the script's name, as its header and trace folders say it

    def summary(self, path: str) -> str:
        """What the magic prints: what was written, how to run it, what was left out."""
        n = len(self.cells)
        lines = [
            f"Wrote {path}: {n} %%dist cell{'s' * (n != 1)} "
            f"({', '.join(f'In[{c}]' for c in self.cells)}).",
            f"Run it with: torchrun --nproc_per_node {self.world_size} {path}",
        ]
        lines += [f"skipped {s}" for s in self.skipped]
        return "\n".join(lines)


# Magics that only set the session up or show it: the script's header replaces them.
SETUP_MAGICS = {"load_ext", "reload_ext", "dist_start", "dist_stop", "dist_export"}
# Magics whose effect the script cannot repeat, and why.
NOT_EXPORTED = {
    "dist_pull": "brings rank values into the notebook; no script equivalent",
    "dist_push": "sends a notebook variable to the ranks; define it in the script instead",
    "dist_restart": "rebuilt the process groups; the script starts them once",
    "dist_interrupt": "stopped a running cell; the script runs every cell to the end",
}
SHOWS_ONLY = "shows the session; no script equivalent"
# A rank replaced alone (%dist_restart --ranks): the script's ranks start once and run on;
# what the new rank was given again (%dist_heal, a cell) is in the script's cells already.
REPLACED = "replaced a rank that died; the script's ranks start once"
_MAGIC = re.compile(r"^\s*%(\w+)")
_IPYTHON_ONLY = re.compile(r"^\s*(%|!(?!=))")


# --------------------------------------------------------------------------- the history


def split_cell(source: str) -> tuple[str | None, str, str]:
    """``%%name line\\nbody`` -> (name, line, body); (None, "", source) for other cells."""
    text = source.lstrip("\n")
    first, _, body = text.partition("\n")
    if not first.startswith("%%"):
        return None, "", source
    name, _, line = first[2:].partition(" ")
    return name.strip(), line.strip(), body


def line_magics(source: str) -> list[tuple[str, str]]:
    """(name, whole line) for each ``%name ...`` line of a cell that is not a cell magic."""
    found = []
    for line in source.splitlines():
        m = _MAGIC.match(line)
        if m and not line.lstrip().startswith("%%"):
            found.append((m.group(1), line.strip()))
    return found


def last_session(history: Sequence[HistoryCell]) -> tuple[list[HistoryCell], str | None]:
    """The cells after the last ``%dist_start`` that did not fail, and its flag line (None
    when no cell started a session: then every cell counts)."""
    for i in range(len(history) - 1, -1, -1):
        cell = history[i]
        if cell.ok is False or split_cell(cell.source)[0] is not None:
            continue
        for name, line in line_magics(cell.source):
            if name == "dist_start":
                return list(history[i + 1 :]), line.split(None, 1)[1] if " " in line else ""
    return list(history), None


def settings_from_start(args: Any) -> Settings:
    """Settings from a parsed ``%dist_start`` line (when no session runs any more)."""
    from .devices import gpu_count
    from .plan_checks import parse_hosts

    if args.gpus or args.nprocs:
        world = gpu_count(args.gpus) or args.nprocs
    elif args.hosts:
        world = sum(slots for _, slots in parse_hosts(args.hosts))
    elif args.nnodes and args.gpus_per_node:
        world = args.nnodes * args.gpus_per_node
    else:
        raise DistUsageError(
            "Cannot tell the number of ranks from the %dist_start line; start the session "
            "again and run %dist_export while it runs."
        )
    on_gpu = bool(args.gpus or args.gpus_per_node)
    backend = args.backend if args.backend != "auto" else ("nccl" if on_gpu else "gloo")
    try:
        layout = ParallelLayout(
            world, tp=args.tp or 1, cp=args.cp or 1, pp=args.pp or 1, dp=args.dp,
            order=args.order or DEFAULT_ORDER, zero1=args.zero1,
        )  # fmt: skip
    except ValueError as e:
        raise DistUsageError(f"The last %dist_start line has a bad layout: {e}") from None
    return Settings(layout, backend, float(args.timeout), _gpus_from_start(args, world))


def _gpus_from_start(args: Any, world: int) -> tuple[str, ...]:
    """The GPUs a ``%dist_start`` line picked, as ids of the kernel's visible GPUs (the
    running session knows their CUDA_VISIBLE_DEVICES entries; this line alone does not)."""
    from .devices import requested_gpus

    wanted = requested_gpus(args.gpus)
    if wanted is None or getattr(args, "launcher", "local") != "local":
        return ()  # CPU ranks, or ranks whose host picks their GPU
    ids = wanted if isinstance(wanted, tuple) else range(world)
    return tuple(str(i) for i in ids)


# --------------------------------------------------------------------------- the script


def export_script(
    history: Sequence[HistoryCell],
    settings: Settings,
    parse_dist_line: Callable[[str], Any],
    filename: str = "script.py",
    *,
    parse_profile_line: Callable[[str], Any] | None = None,
    profile: bool = False,
) -> Export:
    """The script for the ``%%dist`` and ``%%dist_profile`` cells in ``history`` (already cut
    to one session, see ``last_session``). ``parse_dist_line`` and ``parse_profile_line``
    parse their flag lines (the magics' parsers; a profile line is read by its --ranks and
    --where only). ``profile``: profiled cells run under torch.profiler, as they ran.

    Raises DistUsageError when there is no ``%%dist`` cell to export."""
    out = Export(text="", world_size=settings.layout.world_size, filename=filename)
    parsers = {"dist": parse_dist_line, "dist_profile": parse_profile_line or parse_dist_line}
    blocks = []
    for cell in history:
        name, line, body = split_cell(cell.source)
        if name in parsers:
            parse = parsers[name]
            blocks.append(_dist_block(cell, name, line, body, settings, parse, out, profile))
        elif name is None:
            blocks.append(_kernel_block(cell, out))
        else:
            blocks.append(_skip(out, cell.number, f"%%{name} cell", "ran in the notebook's kernel"))
    if not out.cells:
        failed = sum(1 for c in history if split_cell(c.source)[0] in parsers)
        raise DistUsageError(
            (f"None of the {failed} %%dist cells of this session succeeded" if failed else
             "No %%dist cell ran in this session yet")
            + ", so there is nothing to export: run %%dist cells, then %dist_export FILE.py."
        )  # fmt: skip
    body = "\n\n\n".join(b for b in blocks if b)  # two blank lines: cells define classes
    out.text = _header(settings, out, filename) + body + _FOOTER
    return out


def _dist_block(cell, magic, line, body, settings, parse_line, out: Export, profile=False) -> str:
    """A ``%%dist`` or ``%%dist_profile`` cell: its code under its --ranks/--where guard (a
    profiled cell's under torch.profiler with ``profile``), or, for one that failed or is not
    plain Python, its code as comments."""
    what = f"%%{magic} {line}".rstrip()
    title = f"# %% In[{cell.number}]: {what}"
    if cell.ok is False:
        why = "failed in the notebook; left out, its code below as comments"
        out.skipped.append(f"In[{cell.number}]: {what} ({why})")
        return f"{title}\n# skipped: this cell {why}\n" + _commented(body)
    args = parse_line(line)
    guard = _guard(args, settings.layout)
    code, problems = _script_code(body, cell.number, out)
    if code is None:
        why = f"not plain Python ({problems}); left out, its code below as comments"
        out.skipped.append(f"In[{cell.number}]: {what} ({why})")
        return f"{title}\n# skipped: this cell is {why}\n" + _commented(body)
    out.cells.append(cell.number)
    if getattr(args, "background", False):
        title += "\n# (ran with --background in the notebook; runs inline here)"
    if magic == "dist_profile" and profile:
        folder = _profile_folder(out.filename, cell.number)
        title += f"\n# under torch.profiler, as in the notebook: each rank's trace in {folder}/"
        code = f'with profiled("{folder}", device):\n{_indent(code)}'
        out.profiled = True
    elif magic == "dist_profile":
        title += "\n# (profiled in the notebook; %dist_export --profile runs it so here)"
    if guard:
        code = f"{guard}\n{_indent(code)}"
    return f"{title}\n{code}"


def _profile_folder(filename: str, number: int) -> str:
    """Where an exported profiled cell's traces go: dist_profile/<script>-In<N>, beside the
    notebook's own dist_profile/In<N>-<time> folders, never one of those."""
    stem = os.path.splitext(os.path.basename(filename))[0] or "script"
    return f"dist_profile/{stem}-In{number}"


def _guard(args: Any, layout: ParallelLayout) -> str | None:
    """``--ranks 0,2`` -> ``if rank in (0, 2):``; ``--where pp=0`` -> a coordinates test."""
    if args.where:
        if args.ranks:
            raise DistUsageError("Give --ranks or --where, not both.")
        coords = parse_where(args.where)
        try:
            layout.ranks_where(**coords)
        except ValueError as e:
            raise DistUsageError(f"Bad --where {args.where!r}: {e}") from None
        test = " and ".join(f'groups.coords["{d}"] == {v}' for d, v in coords.items())
        return f"if {test}:"
    ranks = parse_ranks(args.ranks, layout.world_size)
    if len(ranks) == layout.world_size:
        return None
    if len(ranks) == 1:
        return f"if rank == {ranks[0]}:"
    if len(ranks) > 8 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"if {ranks[0]} <= rank <= {ranks[-1]}:"
    return f"if rank in ({', '.join(map(str, ranks))}):"


def _script_code(body: str, number: int, out: Export) -> tuple[str | None, str]:
    """The cell body as plain Python: IPython-only lines (magics, ``!shell``) commented out
    and noted, the last expression shown as the notebook shows it. (None, why) if invalid."""
    body = body.rstrip()
    try:
        tree = ast.parse(body)
    except SyntaxError:
        lines = body.splitlines()
        for i, text in enumerate(lines):
            if _IPYTHON_ONLY.match(text):
                indent = text[: len(text) - len(text.lstrip())]
                lines[i] = f"{indent}# skipped (IPython only): {text.strip()}"
                out.skipped.append(f"In[{number}]: {text.strip()} (IPython only, in a %%dist cell)")
        body = "\n".join(lines)
        try:
            tree = ast.parse(body)
        except SyntaxError as e:
            return None, f"{e.msg}, line {e.lineno}"
    if not tree.body:
        return (body + "\n" if body else "") + "pass", ""
    shown = _show_last_value(body, tree)
    out.shows_values |= shown != body
    return shown, ""


def _show_last_value(body: str, tree: ast.Module) -> str:
    """IPython shows a cell's last expression unless it ends with ``;``: print it the same."""
    last = tree.body[-1]
    if not isinstance(last, ast.Expr) or _is_print(last.value):
        return body
    lines = body.splitlines()
    first, end = lines[last.lineno - 1].encode(), lines[last.end_lineno - 1].encode()
    tail = end[last.end_col_offset :].decode()
    if tail.split("#")[0].strip().startswith(";"):
        return body
    expr = ast.get_source_segment(body, last.value)
    head = first[: last.col_offset].decode()
    shown = f"{head}show({expr}){tail}".splitlines()
    return "\n".join(lines[: last.lineno - 1] + shown + lines[last.end_lineno :])


def _is_print(node: ast.expr) -> bool:  # returns None: nothing to show, keep it readable
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print"


def _indent(code: str) -> str:
    """Indent under an ``if``, leaving lines inside multi-line strings as they are."""
    keep = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, (ast.Constant, ast.JoinedStr)) and node.end_lineno > node.lineno:
            keep.update(range(node.lineno + 1, node.end_lineno + 1))
    return "\n".join(
        line if (i in keep or not line.strip()) else "    " + line
        for i, line in enumerate(code.splitlines(), start=1)
    )


def _commented(body: str) -> str:
    return "\n".join(f"# {line}".rstrip() for line in body.rstrip().splitlines())


def _kernel_block(cell: HistoryCell, out: Export) -> str:
    """A cell that ran in the notebook's kernel: its dist magics and its code, as notes."""
    notes = []
    for name, line in line_magics(cell.source):
        if name in SETUP_MAGICS:
            continue
        why = NOT_EXPORTED.get(name, SHOWS_ONLY if name.startswith("dist_") else None)
        if name == "dist_restart" and ("--ranks" in line or " -r " in f"{line} "):
            why = REPLACED
        if why:
            notes.append(_skip(out, cell.number, line, why))
    code = [
        ln for ln in cell.source.splitlines()
        if ln.strip() and not ln.lstrip().startswith(("#", "%"))
    ]  # fmt: skip
    if code:
        notes.append(_skip(out, cell.number, "notebook code", "ran in the kernel, not on ranks"))
    return "\n".join(notes)


def _skip(out: Export, number: int, what: str, why: str) -> str:
    out.skipped.append(f"In[{number}]: {what} ({why})")
    return f"# skipped In[{number}]: {what} ({why})"


def _header(settings: Settings, out: Export, filename: str) -> str:
    layout = settings.layout
    n = layout.world_size
    args = ", ".join(f"{k}={v!r}" for k, v in layout.to_dict().items() if v is not None)
    args = args.replace("'", '"')
    cells = textwrap.fill("Cells " + ", ".join(f"In[{c}]" for c in out.cells), 88)
    left_out = (
        f'\nLeft out ({len(out.skipped)}): see the "# skipped" comments.' if out.skipped else ""
    )
    show = (
        "\n\ndef show(value):  # a cell's last value, printed as the notebook showed it\n"
        "    if value is not None:\n"
        "        print(repr(value))\n"
        if out.shows_values
        else ""
    )
    names = "profiled, torchrun_namespace" if out.profiled else "torchrun_namespace"
    gpus, gpus_arg = _gpus_lines(settings.gpus)
    return f'''"""A notebook's %%dist cells as a torchrun script, written by %dist_export.

{cells}.
Layout {layout.describe()}, backend {settings.backend}. Run it on {n} processes:

    torchrun --nproc_per_node {n} {filename}

Each rank gets the names a %%dist cell sees (torch, dist, rank, world_size, local_rank,
device, groups, mesh, layout) with the same parallel groups, and labels its lines [rank N].
--ranks and --where became `if` guards.{left_out}
"""

import torch
import torch.distributed as dist

from infini_notebook.engine.torchrun import {names}
from infini_notebook.groups import ParallelLayout
{gpus}
ns = torchrun_namespace(
    ParallelLayout({args}),
    backend="{settings.backend}",
    timeout={settings.timeout!r},{gpus_arg}
)
rank, world_size, local_rank = ns["rank"], ns["world_size"], ns["local_rank"]
device, groups, mesh, layout = ns["device"], ns["groups"], ns["mesh"], ns["layout"]
{show}

'''


_FOOTER = "\n\n\ndist.destroy_process_group()\n"


def _gpus_lines(gpus: tuple[str, ...]) -> tuple[str, str]:
    """The script's ``GPUS = (...)`` with its comment, and the argument that passes it:
    each rank on the GPU its session rank had (ranks sharing one, ``--gpus 0,0``, share it
    again); nothing for CPU ranks."""
    if not gpus:
        return "", ""
    listed = ", ".join(f'"{g}"' for g in gpus) + ("," if len(gpus) == 1 else "")
    lines = (
        "\n# The notebook's GPUs (--gpus): rank i ran on GPUS[i], a CUDA_VISIBLE_DEVICES entry"
        "\n# of its kernel; each rank sees and uses the same here. None: cuda:LOCAL_RANK.\n"
        f"GPUS = ({listed})\n"
    )
    return lines, "\n    gpus=GPUS,"


def pick_settings(session, start_line: str | None, parse_start: Callable) -> Settings:
    """The running session's settings, else those of this kernel's last ``%dist_start`` line
    (parsed by ``parse_start``)."""
    if session is not None:
        plan = session.plan  # ranks whose host picked their GPU: no choice to carry
        gpus = plan.gpus if plan.placement.launcher == "local" else ()
        return Settings(session.layout, plan.backend, plan.timeout, tuple(gpus))
    if start_line is not None:
        return settings_from_start(parse_start(start_line))
    raise DistUsageError(
        "No session is running and no %dist_start ran in this kernel, so the layout "
        "is unknown: start a session with %dist_start, then run %dist_export."
    )


def check_path(path: str, force: bool) -> None:
    """Refuse a folder, a missing folder, a link, or an existing file without ``force``."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.islink(path):  # one pointing at nothing too: os.path.exists says False
        raise DistUsageError(
            f"{path!r} is a symbolic link (to {os.readlink(path)!r}): %dist_export writes no "
            "file through a link. Remove it, or give the file's own path."
        )
    if os.path.isdir(path):
        raise DistUsageError(f"{path!r} is a folder: give a file name, like {path}/train.py.")
    if not os.path.isdir(folder):
        raise DistUsageError(f"Folder {folder!r} does not exist: create it or pick another path.")
    if os.path.lexists(path) and not force:
        raise DistUsageError(f"{path!r} exists: pass --force to overwrite it.")


def write_script(path: str, text: str, force: bool = False) -> None:
    """Write the script: never through a link at ``path``, and a new file unless ``force``
    (a file made there after check_path is not overwritten)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    flags |= os.O_TRUNC if force else os.O_EXCL
    try:
        with os.fdopen(os.open(path, flags, 0o666), "w") as f:
            f.write(text)
    except OSError as e:
        raise DistUsageError(f"Cannot write {path!r}: {e.strerror}.") from None
