"""The magics of kept sessions (``%dist_start --name NAME --keep 30m``): %dist_attach takes
one over from a new kernel, %dist_detach lets it go and keeps it, %dist_sessions lists this
user's. %dist_stop NAME (in magics.py) ends one without attaching. See launch/keep.py."""

from __future__ import annotations

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from . import cluster
from .launch import kept_sessions
from .viz.render import text_table


@magics_class
class KeepMagics(Magics):
    @magic_arguments()
    @argument("name", help="the kept session's name (%%dist_start --name NAME --keep 30m)")
    @argument(
        "--force",
        action="store_true",
        help="take it over from the live kernel that drives it (that kernel says so at its "
        "next command)",
    )
    @line_magic
    def dist_attach(self, line: str):
        """Take over a kept session from this kernel: every rank's variables, the groups and
        mesh, %dist_status, %%dist, the session API and %dist_export of its cells. Only the
        user who started it, on this machine; refused while another live kernel drives it
        (the line names it) unless --force. A cell that still runs is named with where its
        output goes; %dist_stacks and %dist_interrupt work on it.
        Example: %dist_attach train
        """
        args = parse_argstring(self.dist_attach, line)
        session, said = cluster.attach(args.name, force=args.force)
        self.shell.user_ns["dist_session"] = session
        print(said)

    @magic_arguments()
    @line_magic
    def dist_detach(self, line: str):
        """Let this kernel's kept session go and keep it: its ranks keep their variables,
        groups and mesh, and its --keep time starts counting (%dist_sessions shows
        "detached, ends in 9m 58s"); %dist_attach NAME from any kernel of yours takes it
        back, without --force. This kernel closes its own connections to it and ends none
        of its processes; it can start or attach another session. An ordinary session
        cannot be detached (it ends with its kernel): %dist_stop ends it.
        Example: %dist_detach
        """
        parse_argstring(self.dist_detach, line)
        from .magics import _session

        said = _session().detach()
        self.shell.user_ns.pop("dist_session", None)
        print(said)

    @line_magic
    def dist_sessions(self, line: str):
        """This user's kept sessions on this machine: name, ranks, backend and GPUs, when
        started, the kernel that drives it or "detached, ends in 8m 20s", memory (the
        proportional share of every process of it: pages shared by forked engines counted
        once). Returns the DataFrame where the line is assigned (df = %dist_sessions).
        """
        import pandas as pd

        from .magics import _assigned

        rows = [kept_sessions.describe(k) for _, k in sorted(kept_sessions.kept_sessions().items())]
        columns = ["name", "ranks", "backend", "started", "driver", "memory"]
        frame = pd.DataFrame(rows, columns=columns)
        if _assigned(self.shell, "dist_sessions"):
            return frame
        if not rows:
            print("No kept session. Start one with %dist_start --nprocs 4 --name NAME --keep 30m.")
        else:
            print(text_table([[r[c] for c in columns] for r in rows], columns))
        return None


def record_cell(result) -> None:
    """IPython's post_run_cell: a cell run while this kernel drives a kept session goes into
    the session's history, so %dist_export works from any kernel that attaches it."""
    session = cluster.current()
    if session is not None and session.keeper.keeps:
        session.keeper.record_cell(result.info.raw_cell or "", bool(result.success))
