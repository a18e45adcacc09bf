#!/usr/bin/env bash
# Set-up for the multi-host tests (tests/test_multinode.py, tests/test_slurm.py): Debian's
# sshd for the two network-namespace "hosts", OpenMPI for the mpi launcher and Slurm (the test
# runs its own one-node slurmctld/slurmd; munge comes along for real clusters). Skipped where
# already present.
set -euo pipefail
need=()
[ -x /usr/sbin/sshd ] || need+=(openssh-server openssh-client)
command -v mpiexec >/dev/null 2>&1 || need+=(openmpi-bin)
[ -x /usr/sbin/slurmctld ] || need+=(slurm-wlm munge)
if [ ${#need[@]} -gt 0 ]; then
    sudo=""
    if [ "$(id -u)" != "0" ]; then sudo="sudo"; fi
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
