"""How often ``%%dist_profile``'s verdict names the rank where a delay starts (issue 50),
on real CPU ranks, against the straggler each case injects.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_verdict.py [--runs 20] [--only NAME]

A session of 4 CPU ranks (gloo, tp 2 x dp 2). Each case makes one rank late (a sleep, or
slow compute) and is profiled ``--runs`` times; a run is right when the verdict names that
rank and every other rank's row says it waited for it (``waited_for``, directly or through
others). Cases (the issue's list):
  chain      0 -> 1 -> 2 -> 3 messages, rank 0 sleeps 0.2 s before each of 3 sends
  send+ar    a late send 0 -> 1 (0.2 s), then an all_reduce of all ranks
  tp+dp      rank 0 0.2 s late into its tp all_reduce, then the dp all_reduce
  1f1b       torch.distributed.pipelining's Schedule1F1B, 4 stages, 4 microbatches, stage 2
             sleeping 30 ms in each forward
  ddp        DDP, 3 steps of a small MLP, rank 1 sleeping 0.1 s before each backward
Prints right/runs per case; the target is runs/runs for each.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

import infini_notebook

CASES = {
    "chain": (
        0,
        """import time
for step in range(3):
    t = torch.ones(1000)
    if rank == 0:
        time.sleep(0.2)
        dist.send(t, 1)
    else:
        dist.recv(t, rank - 1)
        if rank < 3:
            dist.send(t, rank + 1)""",
    ),
    "send+ar": (
        0,
        """import time
t = torch.ones(1000)
if rank == 0:
    time.sleep(0.2)
    dist.send(t, 1)
elif rank == 1:
    dist.recv(t, 0)
dist.all_reduce(t)""",
    ),
    "tp+dp": (
        0,
        """import time
if rank == 0:
    time.sleep(0.2)
dist.all_reduce(torch.ones(4), group=groups.tp)
dist.all_reduce(torch.ones(4), group=groups.dp)""",
    ),
    "1f1b": (
        2,
        """import time
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
class _Stage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
    def forward(self, x):
        if rank == 2:
            time.sleep(0.03)
        return self.lin(x)
torch.manual_seed(0)
_mb = torch.empty(4, 64)  # a microbatch's shape: no shape inference over the wire
_stage = PipelineStage(_Stage(), rank, world_size, torch.device("cpu"), input_args=_mb,
                       output_args=_mb)
_loss = (lambda out, target: out.sum()) if rank == world_size - 1 else None
_sched = Schedule1F1B(_stage, n_microbatches=4, loss_fn=_loss)
_x = torch.randn(16, 64)
if rank == 0:
    _sched.step(_x)
elif rank == world_size - 1:
    _sched.step(target=torch.zeros(16, 64))
else:
    _sched.step()""",
    ),
    "ddp": (
        1,
        """import time
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
_net = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 10)))
for _ in range(3):
    _loss = _net(torch.randn(64, 256)).sum()
    if rank == 1:
        time.sleep(0.1)
    _loss.backward()""",
    ),
}


def right(result, root: int) -> bool:
    rows = result.ranks.to_dict("records")
    return (
        result.straggler is not None
        and result.straggler[0] == root
        and all(r["waited_for"].startswith(f"rank {root}") for r in rows if r["rank"] != root)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--only", choices=sorted(CASES))
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="bench_verdict_")
    session = infini_notebook.start(nprocs=4, tp=2, timeout=120)
    try:
        for name, (root, code) in CASES.items():
            if args.only and name != args.only:
                continue
            session.run(code, echo=False)  # warm: imports, first buckets
            wrong = []
            for i in range(args.runs):
                result = session.profile(code, out=f"{folder}/{name}{i}", echo=False)
                if not right(result, root):
                    wrong.append(result.verdict)
            print(f"{name:8s} {args.runs - len(wrong)}/{args.runs} name rank {root}", flush=True)
            for text in wrong[:3]:
                print(f"         wrong: {text}")
    finally:
        session.stop()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
