"""Slurm specifics on top of ipyparallel's Slurm engine launcher.

ipyparallel submits the batch job and cancels it; it does not say why sbatch refused a job
(its error goes to the kernel's stderr, unseen) nor notice a job that will never start. This
launcher raises sbatch's own message, reports the job's state while the session waits for its
engines, and waits for a cancelled job to leave the queue so its nodes are free again.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time

from ipyparallel.cluster.launcher import SlurmEngineSetLauncher
from traitlets import default

from ..core.errors import DistUsageError
from .watchdog import FOLDER_PREFIX, record_elsewhere

# Pending reasons that no amount of waiting fixes by itself (an admin or a changed request
# must): fail at once instead of waiting out the start timeout.
NEVER_STARTS = {
    "AccountNotAllowed",
    "BadConstraints",
    "DependencyNeverSatisfied",
    "InvalidAccount",
    "InvalidQOS",
    "JobHeldAdmin",
    "JobHeldUser",
    "PartitionConfig",
    "PartitionDown",
    "PartitionInactive",
    "PartitionNodeLimit",
    "PartitionTimeLimit",
    "QOSNotAllowed",
    "ReqNodeNotAvail",
}
STARTING = {"PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED"}
# squeue -j also lists finished jobs for a while (MinJobAge); these still hold their nodes.
HOLDING = STARTING | {"COMPLETING", "SIGNALING", "STAGE_OUT", "STOPPED"}


def start_problem(job_id: str, state: tuple[str, str] | None, log_tail: str = "") -> str | None:
    """Why a job whose engines have not all registered will not bring them up, or None while
    it may still. ``state`` is squeue's (state, reason), None once the job left the queue."""
    if state is None or state[0] not in STARTING:
        ended = "left the queue" if state is None else f"ended ({state[0]})"
        tail = f" Its log ends with:\n{log_tail}" if log_tail.strip() else ""
        return f"Slurm job {job_id} {ended} before its engines came up.{tail}"
    status, reason = state
    if status == "PENDING" and reason.split(",")[0] in NEVER_STARTS:
        return (
            f"Slurm job {job_id} cannot start ({reason}); it was cancelled. "
            "Check --partition, --account and --time against `sinfo` and `sacctmgr show assoc`."
        )
    return None


def waiting_note(job_id: str, state: tuple[str, str] | None) -> str:
    """What the progress line says while engines are not up yet."""
    if state and state[0] == "PENDING":
        reason = "" if state[1] in ("", "None") else f": {state[1]}"
        return f"engines up (Slurm job {job_id} pending{reason})"
    return f"engines up (Slurm job {job_id})"


def last_lines(path: str, n: int = 8) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


class SlurmEngines(SlurmEngineSetLauncher):
    """ipyparallel's Slurm engine set, with clear errors and the job's state."""

    # How long stop() waits for a cancelled job to leave the queue.
    stop_wait = 15.0

    @default("output_file")
    def _default_output_file(self):
        # The job writes its log (every rank's raw output) where the job runs: the submit
        # folder, which (like the notebook's code) must be shared with the nodes; the
        # kernel's temporary folder is not. So it goes in a new private folder there (mode
        # 0700), which the session removes when it ends, and the watchdog if the kernel dies.
        try:
            folder = tempfile.mkdtemp(prefix=f".{FOLDER_PREFIX}slurm-", dir=os.getcwd())
        except OSError as e:
            raise DistUsageError(
                f"The Slurm job writes its log in the notebook's folder {os.getcwd()}, and "
                f"a folder cannot be made there ({e.strerror}): start the session from a "
                "folder you can write that the nodes share."
            ) from None
        record_elsewhere(os.path.dirname(self.profile_dir), folder)
        return os.path.join(folder, f"slurm-{self.identifier}.out")

    def _run_command(self, command, **kwargs):
        try:
            out = subprocess.run(
                command, stdin=subprocess.DEVNULL, capture_output=True, check=True, **kwargs
            )
        except FileNotFoundError:
            raise DistUsageError(
                f"`{command[0]}` is not on PATH: --launcher slurm runs on a Slurm login node "
                "(or inside an allocation)."
            ) from None
        except subprocess.CalledProcessError as e:
            said = (e.stderr or e.stdout or b"").decode("utf8", "replace").strip()
            raise DistUsageError(
                f"Slurm refused: {said or f'{command[0]} exited with {e.returncode}'}. "
                "Check --partition, --account and --time (`sinfo` lists the partitions)."
            ) from None
        return out.stdout.decode("utf8", "replace")

    def job_state(self) -> tuple[str, str] | None:
        """squeue's (state, reason) for our job; None once squeue forgot it."""
        out = subprocess.run(
            ["squeue", "-h", "-j", self.job_id, "-o", "%T|%r"],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        line = out.stdout.strip()
        if out.returncode != 0 or not line:  # squeue errors on ids it has forgotten
            return None
        status, _, reason = line.partition("|")
        return status, reason

    def start_check(self) -> tuple[str | None, str]:
        """(why the engines will never come up or None, the progress note) for a job
        whose engines have not all registered yet."""
        if not self.job_id:
            return None, "engines up"
        state = self.job_state()
        problem = start_problem(self.job_id, state, last_lines(self.output_file))
        return problem, waiting_note(self.job_id, state)

    def stop(self):
        if not self.job_id:  # sbatch refused the job: nothing to cancel
            return self.notify_stop({"job_id": None})
        output = self._run_command(self.delete_command + [self.job_id])
        deadline = time.monotonic() + self.stop_wait
        while (state := self.job_state()) and state[0] in HOLDING and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.notify_stop({"job_id": self.job_id, "output": output})
