"""The magics of the parallel layout: %dist_groups (the rank grid of a session's layout, or
of one planned without a session) and %dist_bench (collective bandwidth per parallel group,
as nccl-tests measures it)."""

from __future__ import annotations

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from . import cluster
from .core.errors import DistUsageError
from .magics import _assigned, _session


@magics_class
class LayoutMagics(Magics):
    @staticmethod
    def _groups_layout(args) -> tuple:
        """%dist_groups: (layout, hosts) from --world flags, else from the running session."""
        from .groups import DEFAULT_ORDER, ParallelLayout

        if args.world is None:
            session = cluster.current()
            if session is None:
                raise DistUsageError(
                    "No session is running. Start one with %dist_start, or plan a layout with "
                    "%dist_groups --world 64 --tp 8 --pp 2."
                )
            return session.layout, [rs.host for rs in session.status()]
        try:
            layout = ParallelLayout(
                args.world, tp=args.tp, cp=args.cp, pp=args.pp, dp=args.dp,
                order=args.order or DEFAULT_ORDER,
            )  # fmt: skip
        except ValueError as e:
            raise DistUsageError(str(e)) from None
        per_host = args.ranks_per_host
        if per_host is not None and per_host < 1:
            raise DistUsageError(f"--ranks-per-host must be at least 1, got {per_host}.")
        from .viz import hosts_by_block

        return layout, hosts_by_block(layout.world_size, per_host) if per_host else None

    @magic_arguments()
    @argument("--color-by", default=None, help="group kind to color by: tp, dp, cp-dp, ...")
    @argument("--world", type=int, help="plan without a session: number of ranks")
    @argument("--tp", type=int, default=1, help="tensor-parallel size (with --world)")
    @argument("--cp", type=int, default=1, help="context-parallel size (with --world)")
    @argument("--pp", type=int, default=1, help="pipeline-parallel size (with --world)")
    @argument("--dp", type=int, default=None, help="data-parallel size (default: the rest)")
    @argument("--order", default=None, help="dims fastest first, default tp-cp-dp-pp")
    @argument("--ranks-per-host", type=int, help="with --world: consecutive ranks per host")
    @line_magic
    def dist_groups(self, line: str):
        """The rank grid of the layout, colored by one kind's groups; click a rank to outline
        all its groups. Without a session, plan one:
        %dist_groups --world 64 --tp 8 --pp 2 --order tp-cp-pp-dp --ranks-per-host 8
        """
        from IPython.display import display

        from . import viz

        args = parse_argstring(self.dist_groups, line)
        layout, hosts = self._groups_layout(args)
        try:
            grid = viz.GroupGrid(layout, color_by=args.color_by, hosts=hosts)
        except ValueError as e:
            raise DistUsageError(str(e)) from None
        display(grid)

    @magic_arguments()
    @argument(
        "collectives",
        nargs="*",
        help="all_reduce (default), all_gather, reduce_scatter, broadcast, reduce, all_to_all,"
        " send_recv, all; or p2p alone for the rank x rank send/recv matrix",
    )
    @argument(
        "--group",
        "-g",
        dest="groups",
        nargs="+",
        action="extend",
        help="group kinds: world (default), layout kinds (tp, dp, cp-dp ...), chunks:N",
    )
    @argument("--sizes", help="MIN:MAX or SIZE in bytes, K/M/G = 1024^n (default 1K:1M on CPU)")
    @argument("--factor", type=float, default=2.0, help="size step factor (default 2)")
    @argument("--iters", type=int, default=20, help="timed iterations per size (default 20)")
    @argument("--warmup", type=int, default=5, help="untimed iterations first (default 5)")
    @argument("--dtype", default="float32", help="float32 (default), bfloat16, float16 ...")
    @argument("--check", action="store_true", help="verify results, count wrong elements")
    @argument(
        "--view", action="store_true", help="interactive view: pick collective, group, busbw/algbw"
    )
    @argument("-o", "--out", default=None, help="notebook variable for the DataFrame")
    @line_magic
    def dist_bench(self, line: str):
        """Collective bandwidth per parallel group, as nccl-tests measures it.

        Prints the table and plots busbw against size; the DataFrame is returned where the
        line is assigned (df = %dist_bench ...), so the numbers are not shown a third time,
        and stored under -o NAME.
        Example: df = %dist_bench all_reduce all_gather --group world tp --sizes 4K:64M
        """
        from IPython.display import display

        from . import viz
        from .kernel import bench

        args = parse_argstring(self.dist_bench, line)
        session = _session()
        if "p2p" in args.collectives:
            if args.collectives != ["p2p"] or args.groups:
                raise DistUsageError("p2p runs alone: %dist_bench p2p [--sizes 4M] [--iters N].")
            result = bench.run_p2p(
                session, args.sizes, iters=args.iters, warmup=args.warmup, dtype=args.dtype,
                progress=viz.Progress("%dist_bench p2p"),
            )  # fmt: skip
            text, hosts = bench.p2p_report(session, result)
            print(text)
            fig = viz.p2p_heatmap(result, hosts=hosts)
        else:
            result = bench.run_bench(
                session,
                args.collectives or None,
                args.groups,
                args.sizes,
                factor=args.factor,
                iters=args.iters,
                warmup=args.warmup,
                dtype=args.dtype,
                check=args.check,
                progress=viz.Progress("%dist_bench"),
            )
            print(bench.format_table(result))
            fig = viz.plot_busbw(result)
        if args.view and "p2p" not in args.collectives:
            display(viz.bench_view(result))  # dropdowns + busbw/algbw toggle
        else:
            display(viz.figure_bundle(fig), raw=True)  # follows the theme
        if args.out:
            self.shell.user_ns[args.out] = result
        return result if _assigned(self.shell, "dist_bench") else None
