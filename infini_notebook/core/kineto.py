"""What ``%%dist_profile`` reads in a rank's torch.profiler (kineto) Chrome trace, named in
one place (pure). The schema is torch 2.13's; where each field comes from:

- CPU side: ``ph: "X"`` events with ``cat`` "cpu_op" (dispatcher ops), "user_annotation"
  (record functions, a backend's ``nccl:*``/``gloo:*`` ones too), "cuda_runtime" and
  "cuda_driver" (launches, with ``args.correlation``); pid/tid are the process and thread.
- GPU side: "kernel", "gpu_memcpy", "gpu_memset" (``pid`` the device, ``tid`` the stream,
  ``args.correlation`` naming its launch) and "gpu_user_annotation": the span of the GPU
  work launched inside a record function, with that record function's ``External id``
  (libkineto's GpuUserEventMap). A kernel NCCL launches itself has no ``External id``, only
  its correlation (seen in a torch 2.11 + NCCL 2.28 trace on an H100).
- ``record_param_comms`` (a cpu_op, torch/csrc/distributed/c10d/ParamCommsUtils.hpp)
  wraps each c10d call of ProcessGroupNCCL; its args are ``saveNcclMeta``'s
  (torch/csrc/profiler/util.cpp, keys in torch/csrc/profiler/util.h): "Collective name",
  "Process Group Name", "Process Group Description", "Process Group Ranks", "Group size",
  "Rank" (for send/recv: the peer's rank in the group), "Dst Rank"/"Src Rank" (the peer's
  global rank, where the group's ranks are known) and, from torch 2.13's
  ``ParamCommsDebugInfo::setSequenceInfo``, "Seq" (the op's sequence number in its group,
  FR's collective_seq_id) when it is known.
- ProcessGroupNCCL's record function (``nccl:all_reduce``, ``nccl:send 0->1``, ...) ends
  as the work is enqueued (``collective()``/``pointToPoint()`` mark the work's future
  completed with the profiling end callback right after the launch), so its CPU span says
  nothing of how long the collective took: the GPU's kernels do.
- ProcessGroupGloo's record function (``gloo:all_reduce``) runs on the group's worker
  thread from when a worker takes the work to when it ends (``AsyncWork::execute``);
  ``gloo:send``/``gloo:recv`` run on the calling thread until the work's ``wait()``.
- Flows: ``ph`` "s"/"f" with ``id`` (a correlation id, numbered per process) and ``cat``
  "ac2g" (launch to kernel) or "fwdbwd".
"""

from __future__ import annotations

START_MARK, STOP_MARK = "infini::profile_start", "infini::profile_stop"
CELL_START, CELL_END = "infini::cell_start", "infini::cell_end"
MARKS = (START_MARK, STOP_MARK, CELL_START, CELL_END)

PARAM_COMMS = "record_param_comms"
NCCL_KERNELS = ("ncclDevKernel", "ncclKernel")
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCHES = ("cuda_runtime", "cuda_driver")
FLOW_PHASES = ("s", "t", "f")
# process metadata the merged trace writes itself (a track per rank)
PROCESS_META = ("process_name", "process_labels", "process_sort_index")


def is_span(ev: dict) -> bool:
    return ev.get("ph") == "X" and "ts" in ev


def end(ev: dict) -> float:
    return ev["ts"] + ev.get("dur", 0)


def is_nccl_kernel(ev: dict) -> bool:
    return ev.get("cat") == "kernel" and str(ev.get("name", "")).startswith(NCCL_KERNELS)


def is_annotation(ev: dict, prefix: str) -> bool:
    """A backend's CPU-side record function (not kineto's GPU copy of it)."""
    return (
        ev.get("cat") == "user_annotation"
        and is_span(ev)
        and str(ev.get("name", "")).startswith(prefix)
    )


def args(ev: dict) -> dict:
    return ev.get("args") or {}
