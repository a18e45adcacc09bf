#!/usr/bin/env bash
# The GPU record in one command, on a machine with CUDA: device, driver, torch/CUDA/NCCL
# versions, the GPU tests (-m gpu) and the all_reduce benchmark on every GPU, then a row
# for docs/gpu.md. Logs go to OUTDIR (default gpu-check/). On a one-GPU machine the
# multi-rank NCCL tests run with four ranks sharing the GPU (tests/test_gpu_shared.py,
# --gpus 0,0,0,0). Bounded to 6 minutes, so a 15-minute lease can run it twice.
#
#   scripts/gpu_check.sh [OUTDIR]
#
# Uses .venv (made here by scripts/setup.sh --test), or the interpreter in $PYTHON as it is
# (a machine without a package registry: see docs/gpu.md for carrying the wheels there).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
mkdir -p "$out"
if ! command -v nvidia-smi > /dev/null; then
    echo "gpu_check: no nvidia-smi here; the GPU tests would all skip" >&2
    exit 1
fi
if [[ -n "${PYTHON:-}" ]]; then
    py=$PYTHON
else
    scripts/setup.sh --test > "$out/setup.log" 2>&1 || { echo "setup failed: $out/setup.log"; exit 1; }
    py=.venv/bin/python
fi

nvidia-smi -L | tee "$out/devices.txt"
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
versions=$("$py" -c "import torch; print(torch.__version__, torch.version.cuda, \
'.'.join(map(str, torch.cuda.nccl.version())), torch.cuda.device_count())")
read -r torch_v cuda_v nccl_v ngpus <<< "$versions"
echo "torch $torch_v, CUDA $cuda_v, NCCL $nccl_v, driver $driver, $ngpus GPUs"

# one process (no xdist: the GPU image lacks it, and the tests share the one GPU)
timeout 330 "$py" -m pytest -m gpu -q -p no:cacheprovider -o addopts="" -rsP -o timeout=150 --durations=15 \
    tests 2>&1 | tee "$out/gpu_tests.log"
tests=$(tail -1 "$out/gpu_tests.log" | sed 's/=//g; s/^ *//; s/ *$//')
timeout 60 "$py" benchmarks/bench_allreduce.py --gpus "$ngpus" --repeats 5 2>&1 | tee "$out/bench.log"
bench=$(grep -m1 "best:" "$out/bench.log" | sed 's/^ *//')

device=$(head -1 "$out/devices.txt" | sed 's/ (UUID.*//; s/^GPU 0: //')
echo
echo "Row for docs/gpu.md (logs in $out/):"
echo "| $(date +%F) | ${ngpus}x $device, driver $driver | torch $torch_v, CUDA $cuda_v, NCCL $nccl_v | scripts/gpu_check.sh: \`-m gpu\`, bench_allreduce --gpus $ngpus | tests: $tests; all_reduce 1 MiB: $bench |"
