"""IPython magics: parse flags, call the public API, turn errors into one clear message.

Every magic is a thin layer over ``infini_notebook.cluster`` (and friends), so scripts and
tests can do without IPython whatever a notebook does.
"""

from __future__ import annotations

import os
import time

from IPython.core.magic import Magics, cell_magic, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from . import cluster
from .core import automode
from .core.automode import AUTO_MARKER
from .core.errors import DistUsageError
from .core.options import StartOptions, flag_specs
from .core.output import RankValues, main_thread_stack
from .core.ranks import parse_ranks, rank_label
from .kernel.printers import TextPrinter
from .viz.status_render import ready_text


def _session() -> cluster.Session:
    session = cluster.current()
    if session is None:
        raise DistUsageError(
            cluster.lost() or "No session is running. Start one with %dist_start --nprocs 4."
        )
    return session


def _assigned(shell, magic: str) -> bool:
    """Whether the running cell assigns this line magic's value (``df = %magic ...``):
    IPython turns it into ``df = get_ipython().run_line_magic('magic', ...)``."""
    cell = (shell.user_ns.get("In") or [""])[-1]
    return f"= get_ipython().run_line_magic('{magic}'" in cell


def _unquote(text: str | None) -> str | None:
    """IPython's magic argument splitter keeps the quotes around a quoted value."""
    if text and len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _start_arguments(magic):
    """%dist_start's flags, one per StartOptions field (options.py writes them once)."""
    for flag, kw in reversed(flag_specs()):
        magic = argument(flag, **kw)(magic)
    return magic


COLLAPSE_HELP = (
    "merge identical lines at the same place in each rank's output, however far apart they "
    "came, into one '[ranks 0-3] ...' line (identical warnings merge always)"
)
MAX_LINES_HELP = "lines shown per rank and stream (2000); all are in the session's output/"


@magics_class
class DistMagics(Magics):
    @magic_arguments()
    @_start_arguments
    @line_magic
    def dist_start(self, line: str):
        """Start one engine per rank with torch.distributed initialised on each.

        Every rank's namespace then holds torch, dist, rank, world_size, local_rank, device,
        groups, mesh and layout. Example: %dist_start --nprocs 4 --tp 2
        """
        args = parse_argstring(self.dist_start, line)
        from . import viz

        options = StartOptions.from_args(args)
        options.ssh_args = _unquote(options.ssh_args)
        session = cluster.start(progress=viz.Progress("%dist_start"), options=options)
        self.shell.user_ns["dist_session"] = session
        rows, how, layout = session.ranks, session.engines.how, session.layout.sizes_text()
        ready = ready_text(session.plan.backend, rows, how, layout, session.kept_line())
        print(f"{ready} Use %%dist to run code.")

    @magic_arguments()
    @argument("--ranks", "-r", default=None, help="ranks to run on: 0 | 0,2 | 1-3 | all")
    @argument("--where", default=None, help="ranks at these layout coordinates: pp=0,tp=1")
    @argument("--collapse", action="store_true", help=COLLAPSE_HELP)
    @argument("--max-lines", type=int, default=None, help=MAX_LINES_HELP)
    @argument(
        "--background",
        action="store_true",
        help="return at once; output fills in below while you run other cells "
        "(%%dist_stacks, %%dist_status); stop it with %%dist_interrupt",
    )
    @cell_magic
    def dist(self, line: str, cell: str):
        """Run the cell on every rank (or a subset) at once; output is labeled [rank N].

        Output shows as it comes, then again in rank order when the cell ends. If any rank
        raises, the cell fails with each rank's traceback labeled. input(), pdb, breakpoint()
        and torch.distributed.breakpoint(rank=1) on a rank ask at the notebook's input box,
        one prompt at a time; the collective timeout (%dist_start --timeout) still bounds
        how long the other ranks wait, so raise it for long debugging.
        """
        self._dist(line, cell)

    def _dist(self, line: str, cell: str, preamble: str = "") -> None:
        """%%dist; ``preamble``: what the cell printed before (kept when it is shown again)."""
        args = parse_argstring(self.dist, line)
        session = _session()
        kw = dict(where=args.where, collapse=args.collapse, max_lines=args.max_lines)
        if args.background:
            from IPython.display import display

            from . import viz

            printer = viz.OutputPrinter()  # refused before the widget shows, if it must be
            session.run_background(cell, args.ranks, printer=printer, **kw)
            display(printer.widget)
            return
        # the cell is all ours: its output is shown again in rank order at its end
        printer = TextPrinter(echo=True, owns_cell=True, preamble=preamble)
        session.run(cell, args.ranks, printer=printer, **kw)

    @magic_arguments()
    @argument("--ranks", "-r", default=None, help="ranks to interrupt (default: all busy)")
    @line_magic
    def dist_interrupt(self, line: str):
        """Send SIGINT to busy ranks: stops a %%dist --background cell."""
        args = parse_argstring(self.dist_interrupt, line)
        ranks = _session().interrupt(args.ranks)
        print(f"Interrupted ranks {ranks}." if ranks else "No background cell is running.")

    @magic_arguments()
    @argument("name", nargs="?", help="a kept session to end without attaching it")
    @line_magic
    def dist_stop(self, line: str):
        """Stop the session: engines, controller and store (and the template %load_ext
        warmed for the next session, if one waits). %dist_stop NAME ends the kept session
        NAME (see %dist_sessions) without attaching it."""
        from .launch import kept_sessions, prewarm

        name = parse_argstring(self.dist_stop, line).name
        session = cluster.current()
        if name and (session is None or session.plan.name != name):
            kept_sessions.stop(name)
            print(f"Session {name!r} stopped.")
            return
        if session is None and cluster.lost():  # another kernel took it, or stopped it
            lost = cluster.lost()
            if "no longer drives" in lost:
                lost += f" Nothing was stopped; %dist_stop {cluster.lost_name()} ends it."
            print(lost)
            return
        if session is None:
            warm = prewarm.warm_template() is not None
            prewarm.discard()
            print("No session is running." + (" Ended the warm template." if warm else ""))
            return
        session.stop()
        self.shell.user_ns.pop("dist_session", None)
        print("Session stopped.")
        self._auto_off("the session stopped")

    @magic_arguments()
    @argument("--hard", action="store_true", help="restart the engines (variables are lost)")
    @argument(
        "--ranks",
        "-r",
        default=None,
        help="replace only these ranks' engines (e.g. 2 or 1,3); the others keep theirs",
    )
    @line_magic
    def dist_restart(self, line: str):
        """Rebuild the process groups under a fresh store prefix, keeping variables.

        Use after a failed or timed-out collective. --ranks 2 starts a new engine for rank
        2 only (a rank that died, or one stuck in native code): every other rank keeps its
        process and variables, and every rank's process groups, `groups` and `mesh` are made
        anew; %dist_heal gives the new rank what its replicas hold. --hard restarts every
        engine (variables are lost). The ranks become the spare engines the session forked
        while idle (%dist_status counts them), so it only has to set them up; the session
        forks new spares once it is idle again.
        """
        args = parse_argstring(self.dist_restart, line)
        from . import viz

        if args.hard and args.ranks is not None:
            raise DistUsageError("%dist_restart: --hard restarts every rank; --ranks only some.")
        session = _session()
        t0 = time.perf_counter()
        progress = viz.Progress("%dist_restart") if args.hard or args.ranks else None
        session.restart(hard=args.hard, progress=progress, ranks=args.ranks)
        if args.ranks is not None:
            how = f"{rank_label(parse_ranks(args.ranks, session.world_size))[1:-1]} replaced, "
            how += "the others kept their variables; process groups made anew"
        else:
            how = "engines restarted" if args.hard else "process groups rebuilt, variables kept"
        print(f"Restarted ({how}) in {time.perf_counter() - t0:.2f}s.")

    @magic_arguments()
    @argument("--ranks", "-r", default=None, help="ranks to show (default all)")
    @argument("--all-threads", action="store_true", help="every thread, not only the cell's")
    @line_magic
    def dist_stacks(self, line: str):
        """Show where each rank is now: its Python stack, taken by a thread on the rank (works
        while a rank is stuck in a collective, and on other hosts)."""
        args = parse_argstring(self.dist_stacks, line)
        for rank, dump in _session().stacks(args.ranks).items():
            text = dump if args.all_threads else main_thread_stack(dump)
            print(f"[rank {rank}]\n{text.rstrip()}\n")

    @line_magic
    def dist_status(self, line: str):
        """Live tiles, one per rank: coordinates, host, device, pid and state (idle, busy,
        failed, released, died, stuck) with a note, under the session's line (ready, rebuilt
        after a failure, or what it needs); they update while cells run. Terminals get the
        same as a text table."""
        from . import viz
        from .launch import prewarm

        if cluster.current() is None:
            raise DistUsageError(
                cluster.lost()
                or "No session is running. Start one with %dist_start --nprocs 4."
                + prewarm.status_note()
            )
        viz.status_widget(_session()).show()  # frozen, it keeps its last text

    @magic_arguments()
    @argument("name", help="variable to bring back from the ranks")
    @argument("--ranks", "-r", default=None, help="ranks to pull from (default all)")
    @argument("-o", "--out", default=None, help="notebook variable to store in (default NAME)")
    @line_magic
    def dist_pull(self, line: str):
        """Bring NAME from the ranks into the notebook as {rank: value}; tensors come as CPU.

        Stored under NAME (or -o) and returned: vals = %dist_pull loss
        """
        args = parse_argstring(self.dist_pull, line)
        values = RankValues(_session().pull(args.name, args.ranks))
        target = args.out or args.name
        self.shell.user_ns[target] = values
        print(f"{target} = {{rank: value}} for ranks {sorted(values)}")
        return values

    @magic_arguments()
    @argument("name", help="notebook variable to send to the ranks")
    @argument("--ranks", "-r", default=None, help="ranks to push to (default all)")
    @line_magic
    def dist_push(self, line: str):
        """Send a notebook variable to the ranks under the same name."""
        args = parse_argstring(self.dist_push, line)
        if args.name not in self.shell.user_ns:
            raise DistUsageError(f"{args.name!r} is not defined in the notebook.")
        _session().push({args.name: self.shell.user_ns[args.name]}, args.ranks)

    @magic_arguments()
    @argument("path", help="the script to write, e.g. train.py")
    @argument("--force", "-f", action="store_true", help="overwrite PATH if it exists")
    @argument(
        "--profile",
        action="store_true",
        help="run %%%%dist_profile cells under torch.profiler, as they ran (a trace per rank)",
    )
    @line_magic
    def dist_export(self, line: str):
        """Write this session's %%dist and %%dist_profile cells, in order, as a script that
        runs under torchrun.

        Each rank of the script gets the names, the parallel groups and the GPU a session's
        rank has (--gpus 4,5,6,7 or 0,0 too), and labels its lines [rank N]; --ranks and
        --where become `if` guards; a %%dist_profile cell runs as plain code, or with
        --profile under torch.profiler (each rank's trace in dist_profile/SCRIPT-In<N>/).
        Cells that failed, code that ran in the notebook's kernel and magics with no script
        equivalent (%dist_pull, %dist_push ...) are left out, each listed here and marked in
        the script.
        Example: %dist_export train.py, then: torchrun --nproc_per_node 4 train.py
        """
        from .core import export

        args = parse_argstring(self.dist_export, line)
        path = os.path.expanduser(_unquote(args.path))
        export.check_path(path, args.force)
        kept = cluster.current()  # a kept session: the cells of every kernel that drove it
        if kept is not None and kept.keeper.keeps:
            history = kept.keeper.history()
        else:
            history = export.history(self.shell.history_manager.input_hist_raw)
        cells, start_line = export.last_session(history)
        settings = export.pick_settings(
            cluster.current(), start_line, lambda flags: parse_argstring(self.dist_start, flags)
        )
        profile_magic = self.shell.find_cell_magic("dist_profile")  # debug_magics: no import
        result = export.export_script(
            cells, settings, lambda flags: parse_argstring(self.dist, flags),
            filename=os.path.basename(path),
            parse_profile_line=lambda flags: parse_argstring(profile_magic, flags),
            profile=args.profile,
        )  # fmt: skip
        export.write_script(path, result.text, args.force)
        print(result.summary(path))

    # ----- auto mode ----------------------------------------------------------------------
    def _auto_off(self, why: str = "") -> None:
        if automode.turn_off(self.shell):
            print(f"Auto mode off{f' ({why})' if why else ''}: cells run in the kernel again.")

    @magic_arguments()
    @argument("state", nargs="?", choices=["on", "off"], help="on or off; none toggles")
    @line_cell_magic
    def dist_auto(self, line: str, cell: str | None = None):
        """Auto mode: while on, every plain cell runs on all ranks as a %%dist cell (labeled
        output, failures as DistCellError), its output headed by '%%dist (auto)'. Cells whose
        first line is a magic (%dist_status, %dist_auto off) still run in the kernel. It
        turns off by itself when the session stops. As a cell magic, %%dist_auto runs one
        cell the way auto mode does.
        """
        if cell is not None:
            return self._auto_cell(cell)
        args = parse_argstring(self.dist_auto, line)
        if not automode.wanted(args.state, automode.is_on(self.shell)):
            if not automode.is_on(self.shell):
                print("Auto mode is off: cells run in the kernel.")
            self._auto_off()
            return
        session = _session()
        automode.turn_on(self.shell)
        print(
            f"Auto mode on: plain cells run on all {session.world_size} ranks as %%dist cells; "
            "cells that start with a magic run here. %dist_auto off to stop."
        )

    @magic_arguments()
    @argument("state", nargs="*", help="on | off; none shows the current state")
    @line_magic
    def dist_autoreload(self, line: str):
        """Edited code on every rank: while on, the kernel and every rank reload the modules
        you edit before each cell (IPython's %autoreload 2). Ranks that do not see the
        notebook's folder (on other hosts) get its .py files changed since their last copy
        sent first (16 MiB at most in all; over it, one line names the files and nothing is
        sent). It stays on across %dist_restart (--hard too) and in a kept session attached
        from another kernel. With no argument it says the current state.
        Example: %dist_autoreload on
        """
        state = [w.lower() for w in parse_argstring(self.dist_autoreload, line).state]
        if state not in ([], ["on"], ["off"]):
            raise DistUsageError(
                "%dist_autoreload takes on, off, or nothing (to show the state), not "
                f"{line.strip()!r}."
            )
        if not state:
            session = cluster.current()
            if session is None:
                print("Autoreload: no session is running (%dist_start, then %dist_autoreload on).")
            else:
                print(session.autoreload_state())
            return
        print(_session().set_autoreload(state == ["on"]))

    def _auto_cell(self, cell: str) -> None:
        """One auto-mode cell: the marker, then the ordinary %%dist path."""
        if cluster.current() is None:
            self._auto_off("no session is running")
            raise DistUsageError(
                "No session is running, so this cell did not run. Start one with "
                "%dist_start --nprocs 4."
            )
        print(AUTO_MARKER, flush=True)
        self._dist("", cell, preamble=f"{AUTO_MARKER}\n")
