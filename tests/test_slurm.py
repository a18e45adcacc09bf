"""`%dist_start --launcher slurm` against a real one-node Slurm on this machine.

The fixture runs Debian's slurm-wlm daemons (slurmctld, slurmd) in the foreground with their
own config, ports and state in a temporary folder (auth/none: one node, loopback only), and
points SLURM_CONF at it for the kernel. It stops only the daemons it started. Skips where
Slurm is not installed (scripts/install_multinode.sh installs it).
"""

from __future__ import annotations

import contextlib
import getpass
import glob
import os
import shutil
import socket
import subprocess
import time

import psutil
import pytest
from conftest import REPO, fresh_kernel, text_of

DAEMONS = ("slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_line() -> str:
    """This machine as slurmd sees it (`slurmd -C`: NodeName=... CPUs=... RealMemory=...)."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()[0]


def reachable_address() -> str | None:
    """An address of this machine other than loopback: the session binds there, as it would
    for a real cluster (a loopback bind with Slurm is refused)."""
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    return next((a for a in out if "." in a and not a.startswith("127.")), None)


def write_conf(tmp: str) -> str:
    user = getpass.getuser()
    host = socket.gethostname().split(".")[0]
    conf = os.path.join(tmp, "slurm.conf")
    with open(conf, "w") as f:
        f.write(
            f"ClusterName=infini\nSlurmctldHost={host}\n"
            f"SlurmctldPort={free_port()}\nSlurmdPort={free_port()}\n"
            "AuthType=auth/none\nCredType=cred/none\n"
            f"SlurmUser={user}\nSlurmdUser={user}\n"
            f"StateSaveLocation={tmp}/state\nSlurmdSpoolDir={tmp}/spool\n"
            f"SlurmctldPidFile={tmp}/slurmctld.pid\nSlurmdPidFile={tmp}/slurmd.pid\n"
            f"SlurmctldLogFile={tmp}/slurmctld.log\nSlurmdLogFile={tmp}/slurmd.log\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nMpiDefault=none\n"
            "JobAcctGatherType=jobacct_gather/none\n"
            "AccountingStorageType=accounting_storage/none\nReturnToService=2\n"
            f"{node_line()} State=UNKNOWN\n"
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
            # Jobs may queue here but never start: the "job that never starts" case.
            "PartitionName=closed Nodes=ALL MaxTime=INFINITE State=DOWN\n"
        )
    for sub in ("state", "spool"):
        os.makedirs(os.path.join(tmp, sub))
    return conf


def slurm(*args: str) -> str:
    return subprocess.run(list(args), capture_output=True, text=True, check=True).stdout


class OneNodeSlurm:
    def __init__(self, tmp: str):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def up(self) -> None:
        conf = write_conf(self.tmp)
        os.environ["SLURM_CONF"] = conf  # before the kernel starts: it inherits os.environ
        for cmd in (["slurmctld", "-D", "-i"], ["slurmd", "-D"]):
            log = open(os.path.join(self.tmp, f"{cmd[0]}.out"), "w")
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=log))
        deadline = time.time() + 30
        while time.time() < deadline:
            with contextlib.suppress(subprocess.CalledProcessError):
                if slurm("sinfo", "-h", "-p", "debug", "-o", "%t").strip() == "idle":
                    return
            time.sleep(0.3)
        raise RuntimeError(f"one-node Slurm did not come up; logs in {self.tmp}")

    def down(self) -> None:
        for proc in self.procs:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def one_node_slurm(tmp_path_factory):
    missing = [d for d in DAEMONS if not shutil.which(d)]
    if missing:
        pytest.skip(
            f"needs Debian's slurm-wlm ({', '.join(missing)} missing; "
            "scripts/install_multinode.sh installs it)"
        )
    saved = os.environ.get("SLURM_CONF")
    cluster = OneNodeSlurm(str(tmp_path_factory.mktemp("slurm")))
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.down()
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved


def engine_pids() -> list[int]:
    """ipyparallel engines anywhere on this machine that our Slurm started (their parent
    chain reaches a slurmstepd)."""
    pids = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "ipyparallel.engine" in cmd:
            with contextlib.suppress(psutil.Error):
                if any(p.name() == "slurmstepd" for p in proc.parents()):
                    pids.append(proc.pid)
    return pids


def test_slurm_session_runs_collectives_and_stop_cancels_the_job(one_node_slurm):
    addr = reachable_address()
    assert addr, "this machine has no address besides loopback"
    logs = os.path.join(REPO, ".infini-notebook-slurm-*")
    before = set(glob.glob(os.path.join(REPO, "slurm*")) + glob.glob(logs))
    with fresh_kernel(timeout=240) as k:
        k.run(
            f"%dist_start --launcher slurm --nnodes 1 --nprocs 2 --partition debug "
            f"--time 00:10:00 --timeout 60 --bind-address {addr}",
            timeout=240,
        )
        jobs = slurm("squeue", "-h", "-o", "%i %T %j").split("\n")
        assert len([j for j in jobs if " RUNNING ipengine-" in j]) == 1, jobs
        out = text_of(
            k.run(
                "%%dist\nimport os\nx = torch.tensor([rank + 1.0]); dist.all_reduce(x)\n"
                "print(os.environ['SLURM_PROCID'], os.environ['SLURM_JOB_ID'], x.item())"
            )
        )
        job_id = jobs[0].split()[0]
        assert f"[rank 0] 0 {job_id} 3.0" in out and f"[rank 1] 1 {job_id} 3.0" in out
        assert engine_pids(), "engines should run under slurmstepd"
        # The job's log (every rank's raw output) is in a folder of the session's, 0700.
        (log_folder,) = set(glob.glob(logs)) - before
        assert os.stat(log_folder).st_mode & 0o777 == 0o700
        assert [n for n in os.listdir(log_folder) if n.startswith("slurm-")]
        k.run("%dist_stop", timeout=120)
        assert slurm("squeue", "-h") == ""  # %dist_stop waits for the job to leave
        deadline = time.time() + 20
        while engine_pids() and time.time() < deadline:
            time.sleep(0.3)
        assert engine_pids() == []
    # Neither the batch script nor the job's log is left in the notebook's folder.
    assert set(glob.glob(os.path.join(REPO, "slurm*")) + glob.glob(logs)) == before


def test_a_job_slurm_refuses_or_never_starts_fails_at_once(one_node_slurm):
    addr = reachable_address()
    with fresh_kernel(timeout=240) as k:
        refused = text_of(
            k.run(
                f"%dist_start --launcher slurm --nnodes 1 --nprocs 2 --partition nope "
                f"--bind-address {addr}",
                allow_error=True,
            )
        )
        assert "DistUsageError" in refused and "invalid partition" in refused.lower(), refused
        pending = text_of(
            k.run(
                f"%dist_start --launcher slurm --nnodes 1 --nprocs 2 --partition closed "
                f"--bind-address {addr}",
                allow_error=True,
                timeout=180,
            )
        )
        # Not the 120 s "only 0 of 2 engines came up" but the reason, at once.
        assert "cannot start (PartitionDown)" in pending, pending
        assert slurm("squeue", "-h") == ""  # the pending job was cancelled


def test_what_a_waiting_job_reports():
    from infini_notebook.launch.slurm import start_problem, waiting_note

    assert start_problem("7", ("PENDING", "Priority")) is None  # a busy cluster: keep waiting
    assert start_problem("7", ("RUNNING", "None")) is None
    assert "cannot start (ReqNodeNotAvail" in start_problem("7", ("PENDING", "ReqNodeNotAvail"))
    gone = start_problem("7", None, "ipengine: No module named ipyparallel\n")
    assert "left the queue" in gone and "No module named ipyparallel" in gone
    assert "ended (FAILED)" in start_problem("7", ("FAILED", "NonZeroExitCode"))
    assert (
        waiting_note("7", ("PENDING", "Resources")) == "engines up (Slurm job 7 pending: Resources)"
    )
    assert waiting_note("7", ("PENDING", "None")) == "engines up (Slurm job 7 pending)"


def test_the_jobs_log_goes_in_a_private_folder_removed_with_the_session(tmp_path, monkeypatch):
    """No Slurm needed: where the job's log goes, and that the session's end (its own or the
    watchdog's) takes that folder with it."""
    from infini_notebook.launch.slurm import SlurmEngines
    from infini_notebook.launch.watchdog import remove_session_folder

    session = tmp_path / "infini-notebook-s1"
    (session / "profile").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # the notebook's folder
    launcher = SlurmEngines(profile_dir=str(session / "profile"), cluster_id="c", work_dir=".")
    folder = os.path.dirname(launcher.output_file)
    assert os.path.dirname(folder) == str(tmp_path)
    assert os.path.basename(folder).startswith(".infini-notebook-slurm-")
    assert os.stat(folder).st_mode & 0o777 == 0o700
    remove_session_folder(str(session))
    assert not os.path.exists(folder) and not session.exists()
