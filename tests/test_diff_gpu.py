"""%dist_diff's checksum on a GPU is the code the CPU tests prove (tests/test_diff.py):
the same numbers on CUDA as on the CPU, for every dtype, views, more than one chunk and
the 10**5 property trials; describing and measuring CUDA leaves. Needs no Jupyter parts
(``pytest --noconftest`` runs it where only torch is installed); skips without CUDA."""

from __future__ import annotations

import pytest
import torch

from infini_notebook.engine.replica_check import (
    as_bytes,
    describe,
    from_bytes,
    largest_difference,
)
from infini_notebook.engine.tensor_hash import CHUNK_WORDS, device_checksum, hash_sums, words

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

QUANTIZED = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}
DTYPES = sorted(
    {str(v).replace("torch.", "") for v in vars(torch).values() if isinstance(v, torch.dtype)}
    - QUANTIZED  # torch has no quantized tensors on CUDA
)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_hashes_to_the_same_sum_on_the_gpu_as_on_the_cpu(dtype):
    dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 2 if dtype == torch.bool else 256, (12 * size,), generator=g)
    raw = raw.to(torch.uint8)
    on_cpu, on_gpu = raw.view(dtype), raw.cuda().view(dtype)
    for a, b in ((on_cpu, on_gpu), (on_cpu[1:5], on_gpu[1:5]), (on_cpu[::3], on_gpu[::3])):
        assert device_checksum(words(a)) == device_checksum(words(b))
        sent = from_bytes(as_bytes(b).clone(), b)
        assert sent.device.type == "cuda" and torch.equal(words(sent).cpu(), words(a))
    assert describe(on_gpu[1:5])["device"] == "cuda"


def test_more_than_a_chunk_and_the_property_trials_give_the_same_numbers():
    g = torch.Generator().manual_seed(1)
    t = torch.randn(CHUNK_WORDS + 1001, generator=g)
    assert device_checksum(words(t.cuda())) == device_checksum(words(t))
    trials = torch.randn(100_000, 16, generator=g).view(torch.int32)
    assert hash_sums(trials.cuda()) == hash_sums(trials)  # int64 arithmetic wraps alike
    changed = t.cuda()
    changed[12345] += 1
    assert device_checksum(words(changed)) != device_checksum(words(t))


def test_cuda_leaves_are_described_and_measured():
    x = torch.arange(20, dtype=torch.bfloat16, device="cuda")[1:9]  # odd byte offset
    assert describe(x)["shape"] == [8]
    fp8 = torch.tensor([1.0, float("nan")], device="cuda").to(torch.float8_e4m3fn)
    assert describe(fp8)["nan"] is True
    half = torch.tensor([1.0, float("inf")], device="cuda", dtype=torch.float16)
    assert describe(half)["inf"] is True and describe(half)["nan"] is False
    big = torch.tensor([2**53, 3], device="cuda")
    assert largest_difference(big + 1, big) == 1
    one, two = (torch.full((3,), v, device="cuda").to(torch.float8_e5m2) for v in (1.0, 2.0))
    assert largest_difference(two, one) == 1.0
