"""init_parallel_groups() from env in a real torchrun job: 8 gloo ranks on loopback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("groups_torchrun_script.py")


def torchrun(env_sizes: dict[str, str], nproc: int = 8) -> list[dict]:
    env = {
        **os.environ,
        **env_sizes,
        "MASTER_ADDR": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",  # gloo pairs on loopback only
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(SCRIPT.parents[1]),
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node", str(nproc), "--rdzv-endpoint", "127.0.0.1:0", str(SCRIPT),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    # ranks print concurrently, so lines may interleave: decode each summary where it starts
    decoder, out = json.JSONDecoder(), proc.stdout
    starts = [m.end() for m in re.finditer(r"OK rank \d+ ", out)]
    assert len(starts) == nproc, out[-3000:]
    return [decoder.raw_decode(out, i)[0] for i in starts]


def test_torchrun_tp2_pp2_from_env():
    results = torchrun({"TP_SIZE": "2", "PP_SIZE": "2"})
    for summary in results:
        assert summary["mesh"] == ["pp", "dp", "cp", "tp"]
        # tp, dp, pp, dp-pp, tp-pp, tp-dp, plus one self group shared by the size-1 kinds
        assert summary["calls_at_init"] == 7, summary
        assert summary["how"]["tp-dp-pp"] == "world (default group)"
        assert summary["how"]["cp-dp"] == "shared"  # cp is 1: the same ranks as dp
        # every group, ad-hoc ones included, has init_process_group's timeout, not torch's
        assert set(summary["timeouts"].values()) == {123.0}, summary["timeouts"]


def test_torchrun_cp_ring_other_order_and_safe_fallback():
    # a user group made before ours leaves ranks with different group counts, so member-only
    # creation is unsafe: the job must fall back to every rank entering every creation
    sizes = {
        "TP_SIZE": "2", "CP_SIZE": "2", "ZERO1_SIZE": "1", "PARALLEL_ORDER": "tp-cp-pp-dp",
        "ASYMMETRIC": "1",
    }  # fmt: skip
    results = torchrun(sizes)
    assert all(s["mesh"] == ["dp", "pp", "cp", "tp"] for s in results)
    assert all(s["how"]["cp"] == "new_group x4" for s in results)
    assert all(set(s["timeouts"].values()) == {123.0} for s in results)
