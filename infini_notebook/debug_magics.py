"""The magics for finding what went wrong on the ranks: %dist_debug (post-mortem: pdb, or
code in the failing frame), %dist_diff (are the replicas still the same?), %dist_heal
(make them the same again, from a healthy replica) and %%dist_profile (which rank is
slow, and how long the others wait for it)."""

from __future__ import annotations

from IPython.core.magic import Magics, cell_magic, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .core.errors import DistUsageError
from .kernel.profile import DEFAULT_MAX_MB
from .magics import _assigned, _session, _unquote


@magics_class
class DebugMagics(Magics):
    # ----- post-mortem --------------------------------------------------------------------
    @magic_arguments()
    @argument("--ranks", "-r", default=None, help="only these of the failed ranks")
    @argument("code", nargs="*", help="line form: the code to run (the cell form runs its body)")
    @line_cell_magic
    def dist_debug(self, line: str, cell: str | None = None):
        """Post-mortem of the last cell that failed, on each rank that failed (or --ranks).
        With no code: pdb in the failing frame (the innermost of your own code), at the
        notebook's input box, one rank at a time (c or q ends it). With code: run it in that
        frame, output labeled per rank. %dist_debug [--ranks 1] | %dist_debug print(x, y)
        | a %%dist_debug [--ranks 1] cell with the code as its body.
        """
        flags_only = cell is None and (not line.strip() or line.lstrip().startswith("-"))
        if cell is None and not flags_only:  # all of the line is code: no flag parsing
            code, ranks = line, None
        else:
            args = parse_argstring(self.dist_debug, line)
            if args.code:
                raise DistUsageError(
                    "%dist_debug --ranks 1 opens pdb; to run code there, put it in a "
                    "%%dist_debug --ranks 1 cell."
                )
            code, ranks = cell or "", args.ranks
        if not code.strip():
            return _session().debug(ranks)
        _session().post_mortem(code, ranks)

    @magic_arguments()
    @argument("--rank", "-r", type=int, default=0, help="the rank to attach to")
    @line_magic
    def dist_debugpy(self, line: str):
        """A VS Code "attach" configuration (launch.json) for one rank: debugpy listens on
        loopback on that rank (an ssh tunnel reaches a rank on another host). One client
        at a time: JupyterLab's debugger, while on, holds every rank's."""
        import json

        from .kernel.rank_debuggers import attach_config

        rank = parse_argstring(self.dist_debugpy, line).rank
        print(json.dumps(attach_config(_session(), rank), indent=2))
        print(
            f'In VS Code: add this to .vscode/launch.json\'s "configurations", then Run and '
            f'Debug > "rank {rank}". The port is this kernel\'s (your user only) and lasts '
            "while it runs; run this again after %dist_restart --hard. Attaching takes the "
            f"rank from JupyterLab's debugger. Breakpoints: in module files; a %%dist cell "
            f"compiles to rank {rank}'s own file, which VS Code opens when the rank stops there."
        )

    @magic_arguments()
    @argument("name", help="a tensor, module, optimizer, state dict or container on each rank")
    @argument(
        "--group",
        "-g",
        default=None,
        help="the kind whose groups should agree (dp; world without dp)",
    )
    @argument("--atol", type=float, default=0.0, help="values this close count as the same")
    @line_magic
    def dist_diff(self, line: str):
        """Are the replicas still the same? Compares NAME within every group of a kind
        (default dp: the ranks that should hold the same values) by checksums computed where
        the data lives; DTensors by their placements (ranks holding the same part; a group
        holding each part once against the first group). Containers by key or index;
        dataclasses, namedtuples and objects with fields field by field (tensors inside as
        tensors); torch.Generator by get_state(), numpy generators by bit_generator.state,
        random.Random by getstate(); sets by content; numpy arrays by their bytes; other
        values by equality. An object that equals only itself is said not compared. Only for
        leaves that differ, the largest difference from the rank compared with (a numpy
        array's also how many elements differ and the first). Prints one line, or a table
        (group, leaf, ranks, compared_with, max_abs_diff, what); returns the DataFrame where
        the line is assigned (diffs = %dist_diff model).
        """
        args = parse_argstring(self.dist_diff, line)
        text, df = _session().diff(args.name, args.group, args.atol)
        print(text)
        if len(df):
            from IPython.display import display

            from .viz import table_bundle

            display(table_bundle(df), raw=True)
        return df if _assigned(self.shell, "dist_diff") else None

    @magic_arguments()
    @argument("names", nargs="+", help="variables on the ranks: modules, optimizers, tensors...")
    @argument(
        "--from",
        dest="group",
        default="dp",
        help="the group kind whose replicas give the value (dp; tp, cp, pp, world, cp-dp ...)",
    )
    @argument("--to", default=None, help="these ranks receive (e.g. 2 or 2,3): default, see below")
    @line_magic
    def dist_heal(self, line: str):
        """Give ranks the value of NAME from a healthy replica in their group (default dp),
        sent over the process group (a broadcast from the source rank; send/recv when only
        some ranks of a group receive), not through the kernel. Who receives: the ranks
        missing NAME, and those replaced (%dist_restart --ranks N) since NAME was last
        healed into them; --to 2 names them instead. The source: the lowest rank of the
        group that holds NAME and does not receive. Modules: parameters and buffers
        overwritten in place (an optimizer over them stays valid), or, where NAME is
        missing, the module rebuilt from the source's pickled module, then its tensors
        sent. Optimizers: state and hyperparameters loaded (create the optimizer first).
        Tensors, DTensors replicated over the group (their local tensor), plain values.
        What has no replica in the group (a DTensor sharded over it, a module whose
        parameters differ in shape, FSDP shards) is named in one line: load it from a
        checkpoint. Prints one line per name: from which rank to which, bytes, time.
        Afterwards %dist_diff NAME --group dp says identical. API: session.heal(names).
        """
        args = parse_argstring(self.dist_heal, line)
        for healed in _session().heal(args.names, args.group, _unquote(args.to)):
            print(healed.line)

    @magic_arguments()
    @argument("--ranks", "-r", default=None, help="run on these ranks only, e.g. 0,2 or 1-3")
    @argument("--where", "-w", default=None, help="run where the layout says, e.g. pp=0")
    @argument("--out", "-o", default=None, help="the folder for the traces")
    @argument("--max-mb", type=float, default=DEFAULT_MAX_MB, help="refuse traces over this size")
    @cell_magic
    def dist_profile(self, line: str, cell: str):
        """Run the cell as %%dist does, under torch.profiler on each rank (CPU, and CUDA on
        GPUs); then one timeline: the ranks' traces merged on one clock (store round trips,
        refined by the collectives' ends) into DIR/merged.json (Perfetto or
        chrome://tracing: a track per rank), each rank's own trace beside it. Shows first
        who made the others wait and how long ("rank 2 arrived last in 3 of 3 all_reduces;
        the other ranks waited 2.7 s each (90 % of the cell)"), then a row per rank
        (compute, communication, waiting for the last peer, idle) and the collectives that
        made the others wait most. DIR: --out, else dist_profile/In<N>-<time>/.
        session.profile(code) returns the DataFrames and the verdict.
        """
        args = parse_argstring(self.dist_profile, line)
        result = _session().profile(
            cell, args.ranks, where=args.where, out=args.out, max_mb=args.max_mb
        )
        from IPython.display import display

        display(result)
