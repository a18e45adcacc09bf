"""GPU path: one rank per GPU on nccl. Skips cleanly where CUDA is absent (as in CI)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import text_of

from infini_notebook import engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_one_gpu_rank_on_nccl_all_reduces_a_cuda_tensor(kernel):
    kernel.run("%dist_start --gpus 1 --timeout 60", timeout=300)
    out = text_of(
        kernel.run(
            "%%dist\nx = torch.ones(4, device=device) * 3\ndist.all_reduce(x)\n"
            "print(dist.get_backend(), x.device.type, x.sum().item())"
        )
    )
    assert "[rank 0] nccl cuda 12.0" in out
    status = text_of(kernel.run("%dist_status"))
    assert "cuda" in status
    kernel.run("%dist_stop")


def test_status_shows_live_gpu_memory_while_a_cell_holds_it():
    import infini_notebook
    from infini_notebook import viz

    session = infini_notebook.start(gpus=1, timeout=60)
    try:
        session.run("import time", echo=False)
        time.sleep(2 * engine.TELEMETRY_INTERVAL_S)
        before = session.status()[0]
        assert before.memory_total and before.memory_used is not None, before
        code = "held = torch.empty(1 << 30, dtype=torch.uint8, device=device)\ntime.sleep(6)"
        cell = threading.Thread(target=session.run, args=(code,), kwargs={"echo": False})
        cell.start()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            rs = session.status()[0]
            if rs.memory_used - before.memory_used >= 1 << 30:
                break
            time.sleep(0.2)
        running = cell.is_alive()
        cell.join(60)
        assert running and rs.memory_used - before.memory_used >= 1 << 30, (before, rs)
        assert f"of {viz._bytes(rs.memory_total)}" in viz.status_tile_html(rs)
    finally:
        session.stop()
