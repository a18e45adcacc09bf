"""Sessions across hosts through ipyparallel's launchers (issue 8).

The ssh test builds two real "hosts" on this machine: network namespaces joined to a bridge
by veth pairs, each running Debian's sshd. It needs root (CAP_NET_ADMIN) and skips with the
reason otherwise. Everything it creates it removes, and it only signals the sshd it started.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import time

import psutil
import pytest
from conftest import Frontend, fresh_kernel, text_of

from infini_notebook.core.plan import make_plan
from infini_notebook.launch.launchers import engine_options

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBNET = "10.213.7"
IFACE = "eth-infini"  # the same name inside both namespaces: GLOO_SOCKET_IFNAME


def sh(*cmd: str, ns: str | None = None) -> None:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    subprocess.run(full, check=True, capture_output=True)


class TwoHosts:
    """Two namespaces with sshd, reachable from here at SUBNET.2 and SUBNET.3."""

    def __init__(self, tmp: str):
        tag = str(os.getpid() % 100000)
        self.bridge = f"inbr{tag}"
        self.names = [f"infini-{tag}-a", f"infini-{tag}-b"]
        self.addrs = [f"{SUBNET}.2", f"{SUBNET}.3"]
        self.tmp = tmp
        self.sshd: list[subprocess.Popen] = []
        self.key = os.path.join(tmp, "id_ed25519")

    def up(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.key], check=True)
        shutil.copy(self.key + ".pub", os.path.join(self.tmp, "authorized_keys"))
        host_key = os.path.join(self.tmp, "host_key")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", host_key], check=True)
        os.makedirs("/run/sshd", exist_ok=True)
        for i, (ns, addr) in enumerate(zip(self.names, self.addrs)):
            veth = f"inv{os.getpid() % 100000}{i}"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", IFACE, "netns", ns)
            sh("ip", "link", "set", veth, "master", self.bridge)
            sh("ip", "link", "set", veth, "up")
            sh("ip", "addr", "add", f"{addr}/24", "dev", IFACE, ns=ns)
            sh("ip", "link", "set", IFACE, "up", ns=ns)
            sh("ip", "link", "set", "lo", "up", ns=ns)
            config = os.path.join(self.tmp, f"sshd_{i}.conf")
            with open(config, "w") as f:
                f.write(
                    f"ListenAddress {addr}\nHostKey {host_key}\nPidFile none\n"
                    f"AuthorizedKeysFile {self.tmp}/authorized_keys\nPermitRootLogin yes\n"
                    "StrictModes no\nUsePAM no\nPasswordAuthentication no\n"
                    "Subsystem sftp /usr/lib/openssh/sftp-server\n"
                )
            # Each host gets its own /tmp (a tmpfs in a private mount namespace), as real
            # hosts have: nothing may rely on files the kernel wrote there. Only our key and
            # config directory (``cd`` keeps it reachable) is bound back in.
            # A checkout under /tmp (a CI clone) is bound back too: the hosts run its Python.
            private_tmp = (
                'cd "$0" && mkdir -p keep && mount --bind "$2" keep '
                '&& mount -t tmpfs tmpfs /tmp && mkdir -p "$0" "$2" '
                '&& mount --no-canonicalize --bind keep "$2" '
                '&& mount --no-canonicalize --bind . "$0" '
                '&& exec /usr/sbin/sshd -D -e -f "$1"'
            )
            self.sshd.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private"]
                    + ["sh", "-c", private_tmp, self.tmp, config, REPO_ROOT],
                    stderr=subprocess.DEVNULL,
                )
            )
        time.sleep(1)

    @property
    def ssh_args(self) -> str:
        return (
            f"-i {self.key} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
            "-o BatchMode=yes -o LogLevel=ERROR"
        )

    def pids_in(self, ns: str) -> set[int]:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        return {int(p) for p in out.split()}

    def down(self) -> None:
        for proc in self.sshd:
            proc.terminate()
            proc.wait(10)
        for ns in self.names:
            for pid in self.pids_in(ns):  # only processes our test's sessions left behind
                psutil.Process(pid).kill()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def _can_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not shutil.which("ip") or not os.path.exists("/usr/sbin/sshd"):
        return "needs iproute2 and openssh-server (scripts/setup.sh --test installs them)"
    probe = f"infini-probe-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "this sandbox does not allow network namespaces"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    reason = _can_make_namespaces()
    if reason:
        pytest.skip(reason)
    two = TwoHosts(str(tmp_path_factory.mktemp("hosts")))
    try:
        two.up()
        yield two
    finally:
        two.down()


def states(k) -> list[str]:
    return ast.literal_eval(text_of(k.run("print([r.state for r in dist_session.status()])")))


def test_two_host_ssh_session(hosts):
    a, b = hosts.addrs
    # ssh does not carry the environment: remote engines import the same tree as the kernel
    here = os.environ.get("PYTHONPATH")
    pythonpath = f"--env PYTHONPATH={here} " if here else ""
    with fresh_kernel(timeout=240) as k:
        start = k.run(
            f"%dist_start --launcher ssh --hosts {a}:2,{b}:2 --tp 2 --timeout 60 "
            f"--bind-address {SUBNET}.1 --env GLOO_SOCKET_IFNAME={IFACE} {pythonpath}"
            f"--ssh-args '{hosts.ssh_args}'",
            timeout=240,
        )
        assert "no authentication" in text_of(start)  # widening the bind address warns
        out = text_of(
            k.run(
                "%%dist\nimport os\nx = torch.tensor([float(rank)]); dist.all_reduce(x)\n"
                "t = torch.tensor([float(rank)]); dist.all_reduce(t, group=groups.tp)\n"
                "print(os.environ['LOCAL_RANK'], os.environ['GROUP_RANK'],"
                " os.environ['LOCAL_WORLD_SIZE'], x.item(), t.item())"
            )
        )
        assert "[rank 0] 0 0 2 6.0 1.0" in out
        assert "[rank 1] 1 0 2 6.0 1.0" in out
        assert "[rank 2] 0 1 2 6.0 5.0" in out
        assert "[rank 3] 1 1 2 6.0 5.0" in out
        ui = Frontend(k, ["carol"])  # input() on a rank of the other host: over the store
        assert ui.run("%%dist --ranks 3\nprint('got', input('who? '))") == "ok"
        assert ui.prompts() == ["[rank 3] who? "] and "[rank 3] got carol" in ui.shown["stdout"]
        status = text_of(k.run("%dist_status"))
        assert status.count(a) == 2 and status.count(b) == 2  # tiles name their host
        assert states(k) == ["idle"] * 4  # known from the controller, not from local pids
        k.run("%%dist --background\nimport time\ndef crunch():\n    time.sleep(4)\ncrunch()")
        time.sleep(1.5)
        assert states(k) == ["busy"] * 4
        stacks = text_of(k.run("%dist_stacks"))  # over the store: no shared /tmp
        assert stacks.count("in crunch") == 4, stacks
        k.run(
            "import time\nwhile 'busy' in [r.state for r in dist_session.status()]: time.sleep(0.2)"
        )
        k.run("%%dist --ranks 2\nraise ValueError('boom')", allow_error=True)
        assert states(k) == ["idle", "idle", "failed", "idle"]
        grid = k.run("%dist_groups --color-by dp")
        html = "".join(o.get("data", {}).get("text/html", "") for o in grid.outputs)
        assert "⇄" in html  # dp groups span the two hosts and are marked
        p2p = text_of(k.run("%dist_bench p2p --sizes 64K --iters 3 --warmup 1"))
        assert "intra-node send bandwidth" in p2p and "inter-node send bandwidth" in p2p
        sshd_pids = {p.pid for p in hosts.sshd}
        for ns in hosts.names:  # engines run inside the namespaces
            assert hosts.pids_in(ns) - sshd_pids - _descendants(sshd_pids)
        k.run("%%dist --ranks 3\nimport os\nos._exit(7)", allow_error=True)
        assert states(k) == ["idle", "idle", "failed", "died"]  # the engine unregistered
        k.run("%dist_stop", timeout=120)
        deadline = time.time() + 20
        while time.time() < deadline:
            leftovers = {ns: _session_pids(hosts, ns) for ns in hosts.names}
            if not any(leftovers.values()):
                break
            time.sleep(0.5)
        assert not any(leftovers.values()), leftovers


def _descendants(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            out |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
        except psutil.Error:
            pass
    return out


def _session_pids(hosts: TwoHosts, ns: str) -> list[str]:
    """Processes in ``ns`` other than our sshd listeners (engines, nannies, ssh sessions)."""
    sshd = {p.pid for p in hosts.sshd}
    sshd |= {c.pid for p in hosts.sshd for c in _children_of(p.pid)}  # `ip netns exec` -> sshd
    left = []
    for pid in hosts.pids_in(ns) - sshd:
        try:
            left.append(" ".join(psutil.Process(pid).cmdline())[:120])
        except psutil.Error:
            pass
    return left


def _children_of(pid: int) -> list[psutil.Process]:
    try:
        proc = psutil.Process(pid)
        return [proc] + [c for c in proc.children() if "sshd" in " ".join(c.cmdline())[:40]]
    except psutil.Error:
        return []


@pytest.mark.skipif(not shutil.which("mpiexec"), reason="needs OpenMPI (openmpi-bin)")
def test_mpi_launcher_on_one_host():
    with fresh_kernel(timeout=240) as k:
        k.run("%dist_start --launcher mpi --nprocs 2 --timeout 60", timeout=240)
        out = text_of(
            k.run(
                "%%dist\nimport os\nx = torch.tensor([rank + 1.0]); dist.all_reduce(x)\n"
                "print(os.environ['OMPI_COMM_WORLD_RANK'], os.environ['LOCAL_RANK'], x.item())"
            )
        )
        assert "[rank 0] 0 0 3.0" in out and "[rank 1] 1 1 3.0" in out
        children = psutil.Process(k.kernel_pid).children(recursive=True)
        k.run("%dist_stop", timeout=120)
        _, alive = psutil.wait_procs(children, timeout=20)
        assert alive == []


def test_slurm_batch_script_carries_the_flags(tmp_path):
    """No Slurm here: check the batch script ipyparallel's Slurm launcher would submit."""
    from ipyparallel.cluster.launcher import SlurmEngineSetLauncher

    plan = make_plan(
        launcher="slurm",
        nnodes=2,
        gpus_per_node=4,
        partition="gpu",
        account="proj42",
        time_limit="01:30:00",
        bind_address="10.0.0.5",
        env=["NCCL_SOCKET_IFNAME=ib0"],
    )
    assert plan.world_size == 8 and plan.backend == "nccl"
    assert plan.placement.rank_places(8)[5] == (1, 1, 4)  # node 1, local rank 1
    opts = engine_options(plan)
    launcher = SlurmEngineSetLauncher(
        work_dir=str(tmp_path), profile_dir=str(tmp_path), cluster_id="t", **opts
    )
    launcher.batch_file = str(tmp_path / "job.sbatch")
    launcher.write_batch_script(plan.world_size)
    script = open(launcher.batch_file).read()
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj42",
        "#SBATCH --time=01:30:00",
        "#SBATCH --ntasks=8",
    ):
        assert line in script, (line, script)
    assert "NCCL_SOCKET_IFNAME" in script and "ipyparallel.engine" in script


def test_mpi_and_slurm_engines_need_no_file_from_the_kernel_host():
    """Other hosts lack the kernel's temporary profile dir: engines get the connection and
    the profile dir's name by environment (mpiexec forwards only what -x names) and create
    the directory themselves."""
    mpi = engine_options(make_plan(launcher="mpi", hosts="n1:2,n2:2", bind_address="10.0.0.5"))
    forwarded = {b for a, b in zip(mpi["mpi_args"], mpi["mpi_args"][1:]) if a == "-x"}
    assert {"IPP_CONNECTION_INFO", "IPP_CLUSTER_ID", "IPP_PROFILE_DIR"} <= forwarded
    slurm = engine_options(make_plan(launcher="slurm", nnodes=2, nprocs=2, bind_address="10.0.0.5"))
    for opts in (mpi, slurm):
        assert "--IPEngine.auto_create=True" in opts["engine_args"]
    assert "--export=ALL" in slurm["batch_template"]  # srun passes the whole environment


def test_remote_hosts_need_a_reachable_bind_address():
    from infini_notebook.core.errors import DistUsageError

    with pytest.raises(DistUsageError, match="--bind-address"):
        make_plan(launcher="ssh", hosts="node1:8,node2:8")
    with pytest.raises(DistUsageError, match="needs --hosts"):
        make_plan(launcher="ssh")
    with pytest.raises(DistUsageError, match="--nnodes"):
        make_plan(launcher="slurm")
    with pytest.raises(DistUsageError, match="HOST:SLOTS"):
        make_plan(launcher="ssh", hosts="node1:x", bind_address="10.0.0.1")


del sys
