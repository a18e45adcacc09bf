"""Synthetic rank traces in the schema torch 2.13's profiler (kineto) writes, with the
Flight Recorder entries and p2p notes a rank sends with them: ground truth for the
profile's arithmetic. Every time given is true time (µs); each rank writes it on its own
trace clock (``trace_base_us`` off) and reads its wall clock ``wall_off_us`` off.

Where each field comes from (see infini_notebook/core/kineto.py for the sources):
- NCCL: c10d's dispatcher op (``c10d::allreduce_``) around ``record_param_comms`` (args of
  torch/csrc/profiler/util.cpp ``saveNcclMeta``: "Process Group Name", "Seq", "Dst Rank",
  ...) around ProcessGroupNCCL's record function (``nccl:all_reduce``, which ends as the work
  is enqueued), inside which NCCL launches its kernel (``cuLaunchKernelEx``, cuda_driver,
  with a correlation id); the kernel (``ncclDevKernel_*``, pid the device, tid the
  stream) has that correlation id and no "External id"; kineto adds a
  ``gpu_user_annotation`` of the same name over it with the record function's External id,
  and an ``ac2g`` flow from launch to kernel. Checked against a torch 2.11 + NCCL 2.28
  trace recorded on an H100 (which lacks only "Seq").
- gloo: ``c10d::allreduce_`` on the calling thread; ``gloo:all_reduce`` on a worker
  thread from when the worker takes the work to its end; ``gloo:send``/``gloo:recv`` on
  the calling thread until ``wait()``; Flight Recorder entries (dump_json, version "2.10")
  for collectives only.
"""

from __future__ import annotations

from infini_notebook.core import kineto
from infini_notebook.core import rank_trace as rt

MAIN = 1  # the cell thread's tid
STREAM_NCCL, STREAM_COMPUTE = 20, 7


class RankBuilder:
    def __init__(self, rank, trace_base_us=0.0, wall_off_us=0.0, rtt_us=400.0, clock_err_us=0.0):
        self.rank, self.base, self.wall_off = rank, trace_base_us, wall_off_us
        self.rtt, self.clock_err = rtt_us, clock_err_us
        self.pid = 5000 + rank
        self.events: list[dict] = [
            {"ph": "M", "name": "process_name", "pid": self.pid, "tid": 0, "ts": 0,
             "args": {"name": "python"}},
            {"ph": "M", "name": "thread_name", "pid": self.pid, "tid": MAIN, "ts": 0,
             "args": {"name": "thread 1 (ipengine)"}},
        ]  # fmt: skip
        self.entries: list[dict] = []
        self.calls: list[dict] = []
        self.marks: dict[str, int] = {}
        self.ext = self.corr = self.record_id = 0
        self.p2p_seq: dict[str, int] = {}
        self.lost = 0

    # clocks
    def at(self, true_us: float) -> float:
        return true_us + self.base

    def wall_ns(self, true_us: float) -> int:
        return int(round((true_us + self.wall_off) * 1000))

    def _x(self, cat, name, start, dur, tid=MAIN, pid=None, **args) -> dict:
        ev = {"ph": "X", "cat": cat, "name": name, "pid": self.pid if pid is None else pid,
              "tid": tid, "ts": self.at(start), "dur": dur, "args": args}  # fmt: skip
        self.events.append(ev)
        return ev

    def _external(self) -> int:
        self.ext += 1
        return self.ext

    def mark(self, name: str, true_us: float, dur: float = 2, read_at: float = 1) -> None:
        """A mark spanning ``dur`` µs, the wall clock read ``read_at`` µs into it."""
        self._x("user_annotation", name, true_us, dur, **{"External id": self._external()})
        self.marks[name] = self.wall_ns(true_us + read_at)  # read inside the mark

    def cell(self, start: float, end: float, profiler_lead_us: float = 0.0) -> None:
        """The profiler's marks ``profiler_lead_us`` around the cell's own marks."""
        self.mark(kineto.START_MARK, start - profiler_lead_us)
        self.mark(kineto.CELL_START, start)
        self.mark(kineto.CELL_END, end - 2)
        self.mark(kineto.STOP_MARK, end + profiler_lead_us)

    def cpu_op(self, name: str, start: float, dur: float, tid=MAIN) -> None:
        self._x("cpu_op", name, start, dur, tid, **{"External id": self._external()})

    def _entry(self, name, group, desc, seq, created, p2p=False) -> None:
        self.entries.append(
            {
                "record_id": self.record_id,
                "pg_id": 0,
                "process_group": [group, desc],
                "collective_seq_id": seq if not p2p else 0,
                "p2p_seq_id": 0,
                "op_id": seq,
                "profiling_name": name,
                "time_created_ns": self.wall_ns(created),
                "state": "scheduled",
                "retired": True,
                "is_p2p": p2p,
            }  # fmt: skip
        )
        self.record_id += 1

    # gloo
    def gloo_collective(self, name, group, seq, enqueue, start, end, worker, desc="default_pg"):
        self.cpu_op("c10d::allreduce_", enqueue, 30)
        self._entry(name, group, desc, seq, enqueue + 5)
        self._x("user_annotation", name, start, end - start, tid=worker,
                **{"External id": self._external()})  # fmt: skip

    def gloo_p2p(self, op, group, peer, post, end, desc="default_pg", note=True):
        if note:
            self.calls.append({"op": op, "group": group, "desc": desc, "peer": peer,
                               "tid": MAIN, "wall_ns": self.wall_ns(post)})  # fmt: skip
        self.cpu_op("c10d::send" if op == "send" else "c10d::recv_", post + 2, 40)
        self._x("user_annotation", f"gloo:{op}", post + 10, end - post - 10,
                **{"External id": self._external()})  # fmt: skip

    # NCCL
    def _params(self, name, group, desc, ranks, seq=None, peer_rank=None, peer=None):
        args = {"External id": self._external(), "Collective name": name,
                "Process Group Name": group, "Process Group Description": desc,
                "Process Group Ranks": str(ranks), "Group size": len(ranks),
                "Rank": ranks.index(self.rank) if peer_rank is None else peer_rank,
                "dtype": "Float", "In msg nelems": 1024, "Out msg nelems": 1024}  # fmt: skip
        if seq is not None:
            args["Seq"] = seq
        if peer is not None:
            args["Dst Rank" if name == "send" else "Src Rank"] = peer
        return args

    def _launch(self, annotation: dict, at: float, kstart: float, kend: float, kernel: str):
        self.corr += 1
        self._x("cuda_driver", "cuLaunchKernelEx", at, 8, correlation=self.corr, cbid=652)
        self.events.append({"ph": "s", "id": self.corr, "pid": self.pid, "tid": MAIN,
                            "ts": self.at(at), "cat": "ac2g", "name": "ac2g"})  # fmt: skip
        self._x("kernel", kernel, kstart, kend - kstart, tid=STREAM_NCCL, pid=0,
                device=0, context=1, stream=STREAM_NCCL, correlation=self.corr)  # fmt: skip
        self.events.append(
            {
                "ph": "f",
                "id": self.corr,
                "pid": 0,
                "tid": STREAM_NCCL,
                "ts": self.at(kstart),
                "cat": "ac2g",
                "name": "ac2g",
                "bp": "e",
            }
        )
        self._x(
            "gpu_user_annotation",
            annotation["name"],
            kstart,
            kend - kstart,
            tid=STREAM_NCCL,
            pid=0,
            **{"External id": annotation["args"]["External id"]},
        )

    def nccl_collective(
        self, group, seq, ranks, enqueue, kstart, kend, desc="default_pg", name="allreduce",
        title="nccl:all_reduce", with_seq=True, record=False,
    ):  # fmt: skip
        self.cpu_op(f"c10d::{name}_", enqueue, 60)
        self._x(
            "cpu_op",
            "record_param_comms",
            enqueue + 5,
            50,
            **self._params(name, group, desc, ranks, seq if with_seq else None),
        )
        ann = self._x("user_annotation", title, enqueue + 10, 30,
                      **{"External id": self._external()})  # fmt: skip
        if record:
            self._entry(title, group, desc, seq, enqueue + 12)
        self._launch(
            ann,
            enqueue + 15,
            kstart,
            kend,
            "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        )

    def nccl_p2p(self, op, group, ranks, peer, enqueue, kstart, kend, desc="default_pg"):
        """A send or recv of its own (not batched): ``nccl:send 0->1`` (group ranks)."""
        seq = self.p2p_seq[group] = self.p2p_seq.get(group, 0) + 1
        me, them = ranks.index(self.rank), ranks.index(peer)
        self.cpu_op("c10d::send" if op == "send" else "c10d::recv_", enqueue, 60)
        self._x(
            "cpu_op",
            "record_param_comms",
            enqueue + 5,
            50,
            **self._params(op, group, desc, ranks, seq, peer_rank=them, peer=peer),
        )
        arrow = "->" if op == "send" else "<-"
        ann = self._x("user_annotation", f"nccl:{op} {me}{arrow}{them}", enqueue + 10, 30,
                      **{"External id": self._external()})  # fmt: skip
        self._launch(
            ann,
            enqueue + 15,
            kstart,
            kend,
            "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
        )

    def kernel(self, name: str, start: float, end: float) -> None:
        """A compute kernel on the compute stream (launched by an aten op)."""
        ext = self._external()
        self._x(
            "kernel",
            name,
            start,
            end - start,
            tid=STREAM_COMPUTE,
            pid=0,
            **{"External id": ext, "device": 0, "stream": STREAM_COMPUTE},
        )

    def trace(self) -> rt.RankTrace:
        kernel_before = 10_000_000.0  # the store sample: the rank read its clock mid-trip
        sample = (
            int(kernel_before * 1000),
            int((kernel_before + self.rtt / 2 + self.wall_off + self.clock_err) * 1000),
            int((kernel_before + self.rtt) * 1000),
        )
        return rt.RankTrace(
            self.rank,
            [dict(e) for e in self.events],
            dict(self.marks),
            list(self.entries),
            rt.best_sample([sample]),
            p2p=list(self.calls),
            fr_lost=self.lost,
        )
