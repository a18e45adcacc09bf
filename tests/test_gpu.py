"""GPU path: one rank per GPU on nccl. Skips cleanly where CUDA is absent (as in CI)."""

from __future__ import annotations

import pytest
import torch
from conftest import text_of

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
