"""Whether the warm template (template.py) may fork now: one thread, and no CUDA driver
state a forked child would inherit unusable. Read from /proc; torch is asked only whether
it initialised CUDA."""

from __future__ import annotations

import os


def fork_refusal() -> str | None:
    """Why forking now would be unsafe, None when it is safe."""
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads != 1:
        return f"the template runs {threads} threads (a forked child would keep their locks)"
    import torch

    if torch.cuda.is_initialized():
        return "the template has initialised CUDA (a forked child cannot use it)"
    return driver_refusal(open_files())


# cuInit opens the UVM device and keeps it open for the life of the process. Everything that
# initialises the CUDA driver goes through cuInit: torch's CUDA init, torch.cuda.is_available()
# (cudaGetDeviceCount, which also marks torch's forks bad without torch.cuda.is_initialized()
# saying so: poison_fork in THCPModule_getDeviceCount_wrap, torch/csrc/cuda/Module.cpp), CuPy,
# Numba, JAX. A child forked after it fails at its first CUDA call ("Cannot re-initialize CUDA
# in forked subprocess"). NVML opens only /dev/nvidiactl and /dev/nvidiaN (nvidia-smi works
# without the nvidia-uvm module; CUDA does not), and torch.cuda.device_count() uses NVML because
# it leaves forks usable; libcuda.so merely loaded (in /proc/self/maps) is harmless too. So the
# UVM file is the sign: refusing on the others would give up warm starts wherever the template
# counted its GPUs. (WSL's driver uses /dev/dxg instead: there only torch's own check applies.)
CUDA_DRIVER_FILE = "/dev/nvidia-uvm"


def driver_refusal(open_paths: list[str]) -> str | None:
    """Why the CUDA driver state forbids forking, None when it does not; ``open_paths``: what
    the process's file descriptors point to (see ``open_files``)."""
    if any(path.startswith(CUDA_DRIVER_FILE) for path in open_paths):
        return (
            "the template has initialised the CUDA driver (it holds /dev/nvidia-uvm open: "
            "something it imported ran cuInit), so a forked rank could not use CUDA"
        )
    return None


def open_files(fd_dir: str = "/proc/self/fd") -> list[str]:
    """What each open file descriptor of this process points to (paths, ``socket:[N]``)."""
    targets = []
    for fd in os.listdir(fd_dir) if os.path.isdir(fd_dir) else []:
        try:
            targets.append(os.readlink(os.path.join(fd_dir, fd)))
        except OSError:  # closed since (listdir's own descriptor)
            pass
    return targets
