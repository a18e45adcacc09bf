"""Sessions across hosts through ipyparallel's launchers (issue 8).

The ssh test builds two real "hosts" on this machine: network namespaces joined to a bridge
by veth pairs, each running Debian's sshd. It needs root (CAP_NET_ADMIN) and skips with the
reason otherwise. Everything it creates it removes, and it only signals the sshd it started.
"""

from __future__ import annotations

import ast
import os
import shutil
import socket
import subprocess
import sys
import time

import psutil
import pytest
from conftest import Frontend, fresh_kernel, text_of
from other_user import needs_root

from infini_notebook.core.plan_checks import make_plan
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
        for addr in self.addrs:  # each sshd listening (a fixed second raced it under load)
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection((addr, 22), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, f"no sshd on {addr} in 30 s"
                    time.sleep(0.05)

    def ssh(self, addr: str, command: str, stdin: str = "") -> str:
        """``command`` run by sh on host ``addr`` as root (its own /tmp)."""
        out = subprocess.run(
            ["ssh", *self.ssh_args.split(), addr, command],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
        )
        # ssh's own failures (255) are the test's, not the command's: say them
        # ssh's own failures (255) are the test's, not the command's: say them
        assert out.returncode != 255, f"ssh {addr}: {out.stderr}"
        return out.stdout

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


# The kernel's folder, at a path the test knows before the session starts (another user of the
# host can read it in ``ls /tmp`` and ``ps``).
KNOWN_FOLDER = """\
import os, types, infini_notebook.launch.folder as _folder
def _known():
    os.mkdir({path!r}, 0o700)
    return {path!r}
_folder.private_place = types.SimpleNamespace(new_session_folder=_known)
"""
# What uid 65534 leaves at that path on a host, before the session starts.
PLANT = (
    "setpriv --reuid=65534 --regid=65534 --clear-groups sh -c "
    "'umask 0; mkdir -p {path}/profile && cat > {path}/profile/ipengine_config.py'"
)
ATTACK_CONFIG = "open({marker!r}, 'w').write('ran')\n"


def session_folders(hosts: TwoHosts, addr: str) -> list[str]:
    return hosts.ssh(addr, "ls -d /tmp/infini-notebook-* 2>/dev/null").split()


def relay_folders(hosts: TwoHosts, addr: str) -> list[str]:
    return hosts.ssh(addr, "ls -d /tmp/infini-relay-* 2>/dev/null").split()


def completed_by_controller(k) -> list[int]:
    """How many tasks the controller has seen each rank's engine complete."""
    return ast.literal_eval(
        text_of(
            k.run(
                "_q = dist_session.engines.client.queue_status()\n"
                "print([_q[dist_session.engines.eid(r)]['completed'] for r in range(4)])"
            )
        )
    )


def test_two_host_ssh_session(hosts):
    a, b = hosts.addrs
    # ssh does not carry the environment: remote engines import the same tree as the kernel
    here = os.environ.get("PYTHONPATH")
    pythonpath = f"--env PYTHONPATH={here} " if here else ""
    # Another user made the kernel's folder path on host a first, with an engine config.
    known = f"/tmp/infini-notebook-known{os.getpid()}"
    marker = f"{known}/ran"
    hosts.ssh(a, PLANT.format(path=known), stdin=ATTACK_CONFIG.format(marker=marker))
    assert session_folders(hosts, a) == [known]
    with fresh_kernel(timeout=240) as k:
        k.run(KNOWN_FOLDER.format(path=known))
        start = k.run(
            f"%dist_start --launcher ssh --hosts {a}:2,{b}:2 --tp 2 --timeout 60 --relay "
            f"--bind-address {SUBNET}.1 --env GLOO_SOCKET_IFNAME={IFACE} {pythonpath}"
            f"--ssh-args '{hosts.ssh_args}'",
            timeout=240,
        )
        assert "no authentication" in text_of(start)  # widening the bind address warns
        assert text_of(k.run("print(dist_session.folder.path)")).strip() == known
        assert hosts.ssh(a, f"ls {marker} 2>&1").strip().endswith("No such file or directory")
        # Each host's engines had a folder of their own, removed once their ranks were set up.
        assert session_folders(hosts, a) == [known] and session_folders(hosts, b) == []
        # issue 54: a relay on each host (--relay), its sockets in a folder of its own there
        assert len(relay_folders(hosts, a)) == 1 and len(relay_folders(hosts, b)) == 1
        before = completed_by_controller(k)
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
        assert completed_by_controller(k) == before, out  # the hosts' relays carried the cell
        ui = Frontend(k, ["carol"])  # input() on a rank of the other host: over the store
        assert ui.run("%%dist --ranks 3\nprint('got', input('who? '))") == "ok"
        assert ui.prompts() == ["[rank 3] who?"] and "[rank 3] got carol" in ui.shown["stdout"]
        status = text_of(k.run("%dist_status"))
        assert status.count(a) == 2 and status.count(b) == 2  # tiles name their host
        assert states(k) == ["idle"] * 4  # known from the controller, not from local pids
        gate = os.path.join(hosts.tmp, "gate")  # bound into both hosts' /tmp
        open(gate, "w").close()
        k.run(
            f"%%dist --background\nimport os, time\ndef crunch():\n"
            f"    while os.path.exists({gate!r}):\n        time.sleep(0.05)\ncrunch()"
        )
        assert states(k) == ["busy"] * 4
        deadline = time.monotonic() + 60
        while True:  # every rank in it (a slow start is no failure), or 60 s
            stacks = text_of(k.run("%dist_stacks"))  # over the store: no shared /tmp
            if stacks.count("in crunch") == 4 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        os.remove(gate)
        assert stacks.count("in crunch") == 4, stacks
        k.run(
            "import time\nwhile 'busy' in [r.state for r in dist_session.status()]: time.sleep(0.2)"
        )
        _autoreload_reaches_the_other_hosts(k, hosts)
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
        # issue 51: a new rank 3 on host b, through the ssh launcher; the others stay
        pids = "print([r.pid for r in dist_session.status()])"
        kept = ast.literal_eval(text_of(k.run(pids)))[:3]
        out = text_of(k.run("%dist_restart --ranks 3", timeout=180))
        assert "rank 3 replaced" in out, out
        out = text_of(k.run(
            "%%dist\nimport os\nx = torch.ones(1); dist.all_reduce(x)\n"
            "print(x.item(), os.environ['GROUP_RANK'], os.environ['LOCAL_RANK'])"
        ))  # fmt: skip
        assert "[rank 3] 4.0 1 1" in out and "[rank 0] 4.0 0 0" in out, out
        now = ast.literal_eval(text_of(k.run(pids)))
        assert now[:3] == kept and now[3] not in kept, (kept, now)  # the others stayed
        assert now[3] in hosts.pids_in(hosts.names[1])  # the new rank 3 runs on host b
        _the_debugger_reaches_a_rank_on_the_other_host(k, hosts)
        k.run("%dist_stop", timeout=120)
        deadline = time.time() + 20
        while time.time() < deadline:
            leftovers = {ns: _session_pids(hosts, ns) for ns in hosts.names}
            if not any(leftovers.values()):
                break
            time.sleep(0.5)
        assert not any(leftovers.values()), leftovers
    assert session_folders(hosts, a) == [known] and session_folders(hosts, b) == []
    assert relay_folders(hosts, a) == relay_folders(hosts, b) == []  # each relay removed its
    assert hosts.ssh(a, f"ls {marker} 2>&1").strip().endswith("No such file or directory")
    hosts.ssh(a, f"rm -rf {known}")


# Another user (uid 65534 where it can) who knows only the store's port. While the kernel
# lives it copies the newest signed heartbeat, deleting the key every 100 ms for its first
# ``delete_s`` seconds; once the kernel's store is gone it serves the copy from a store of
# its own on the freed port.
ATTACKER = r"""
import sys, time
from datetime import timedelta
import torch.distributed as dist
host, port, delete_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=3))
key = value = None
t0 = time.monotonic()
deleting = True
while True:
    try:
        names = [k.decode() if isinstance(k, bytes) else k for k in store.list_keys()]
        key = key or next((k for k in names if k.endswith("/infini/alive")), None)
        if key and store.check([key]):
            value, said = store.get(key), value
            if said is None:
                print("copied", flush=True)
            if deleting:
                store.delete_key(key)
        if deleting and time.monotonic() - t0 > delete_s:
            deleting = False
            print("deleted", flush=True)
    except Exception:
        break  # the kernel's store is gone
    time.sleep(0.1)
for _ in range(200):
    try:
        foreign = dist.TCPStore(host, port, is_master=True, timeout=timedelta(seconds=3))
        break
    except Exception:
        time.sleep(0.05)
print("serving", flush=True)
while True:
    foreign.set(key, value)
    time.sleep(0.05)
"""

# A rank's pid and the fd of the engine's own stderr (ipykernel's stream keeps it as fileno).
RANK_STDERR = "%%dist\nimport os, sys\nprint(os.getpid(), sys.stderr.fileno())"
WINDOW_S = int(os.environ.get("INFINI_TEST_WINDOW_S", 3))  # the rank's window (60 s by default)


def test_the_heartbeat_of_a_remote_rank_survives_deletion_and_replay(hosts):
    """Issue 49, on a rank on host b, by another user who knows only the store's port.
    Deleting the heartbeat key ended every remote rank within a window although the kernel
    lived: deleted every 100 ms for over 2 windows, the rank stays and the kernel says it
    once. A copied beat, served from the attacker's store on the freed port once the kernel
    is gone, kept the rank alive for over 110 s: now it ends within its window, saying what
    it saw."""
    from other_user import popen_as_other

    b = hosts.addrs[1]
    here = os.environ.get("PYTHONPATH")
    pythonpath = f"--env PYTHONPATH={here} " if here else ""
    before = hosts.pids_in(hosts.names[1])
    with fresh_kernel(timeout=240) as k:
        k.run(
            f"%dist_start --launcher ssh --hosts {b}:1 --timeout 60 --bind-address {SUBNET}.1 "
            f"--env GLOO_SOCKET_IFNAME={IFACE} --env INFINI_NOTEBOOK_STORE_LOST_AFTER_S="
            f"{WINDOW_S} {pythonpath}--ssh-args '{hosts.ssh_args}'",
            timeout=240,
        )
        pid, fd = map(int, text_of(k.run(RANK_STDERR)).split()[-2:])
        port, kernel = ast.literal_eval(
            text_of(k.run("import os\nprint((dist_session.rendezvous.port, os.getpid()))"))
        )
        assert pid in hosts.pids_in(hosts.names[1]) - before  # the rank runs on host b
        rank = psutil.Process(pid)
        last_words = open(f"/proc/{pid}/fd/{fd}", "rb")  # its log: readable once it ended
        attacker = subprocess.Popen(
            [sys.executable, "-c", ATTACKER, f"{SUBNET}.1", str(port), str(2 * WINDOW_S + 1)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, **popen_as_other(),
        )  # fmt: skip
        try:
            assert attacker.stdout.readline().strip() == "copied"
            wait = f"%%dist\nimport time\ntime.sleep({2 * WINDOW_S + 1})\nprint('here')"
            out = text_of(k.run(wait, timeout=3 * WINDOW_S + 60))
            assert attacker.stdout.readline().strip() == "deleted"
            assert "[rank 0] here" in out and rank.is_running(), out
            assert out.count("heartbeat was deleted from its store") == 1, out
            time.sleep(1.5)  # it copies a few more beats: the newest is what it serves
            os.kill(kernel, 9)  # the kernel is gone, the port free
            t0 = time.monotonic()
            assert attacker.stdout.readline().strip() == "serving"
            rank.wait(WINDOW_S + 30)
            took = time.monotonic() - t0
        finally:
            attacker.kill()
            attacker.wait()
    said = last_words.read().decode(errors="replace")
    assert "no fresh signed heartbeat from the kernel" in said, said[-2000:]
    assert "only an old heartbeat" in said, said[-2000:]
    assert took < WINDOW_S + 8, took  # it was over 110 s


def _autoreload_reaches_the_other_hosts(k, hosts: TwoHosts) -> None:
    """%dist_autoreload with the notebook's folder in the kernel's /tmp, which neither host
    sees: its .py files reach every rank, edits too, and a change over the cap is named."""
    import tempfile

    nb = tempfile.mkdtemp(prefix="autoreload-nb-")
    module = os.path.join(nb, "armod.py")

    def edit(n: int) -> None:  # a size per version: Python's bytecode check is by seconds
        with open(module, "w") as f:
            f.write(f"def f():\n    return 'v{n}'{' ' * n}\n")

    edit(1)
    try:
        k.run(f"import os\nos.chdir({nb!r})")
        said = text_of(k.run("%dist_autoreload on"))
        assert "ranks 0-3, which do not see it, get its changed .py files sent first" in said
        out = text_of(k.run("%%dist\nimport armod\nprint(armod.f())"))
        assert all(f"[rank {r}] v1" in out for r in range(4)), out
        edit(2)
        out = text_of(k.run("%%dist\nprint(armod.f())"))
        assert all(f"[rank {r}] v2" in out for r in range(4)), out
        copies = [f for a in hosts.addrs for f in session_folders(hosts, a) if "-code-" in f]
        assert len(copies) == 4  # a folder of each rank's own in its host's /tmp
        with open(os.path.join(nb, "big.py"), "w") as f:  # over the 16 MiB cap
            f.write("#" * (17 * 2**20) + "\n")
        edit(3)
        out = text_of(k.run("%%dist\nprint(armod.f())"))
        assert "autoreload: nothing sent to ranks 0-3 (other hosts)" in out, out
        assert "over the 16.0 MiB cap (big.py 17.0 MiB, armod.py 0.0 MiB)" in out
        assert all(f"[rank {r}] v2" in out for r in range(4)), out  # the code they had
        os.unlink(os.path.join(nb, "big.py"))
        out = text_of(k.run("%%dist\nprint(armod.f())"))
        assert all(f"[rank {r}] v3" in out for r in range(4)) and "cap" not in out, out
        k.run("%dist_autoreload off")
    finally:
        k.run(f"os.chdir({REPO_ROOT!r})")
        shutil.rmtree(nb)


def _the_debugger_reaches_a_rank_on_the_other_host(k, hosts: TwoHosts) -> None:
    """Issue 52: JupyterLab's debugger pauses rank 3 on host b, over its signed relay on the
    address host b reaches the kernel by (its own loopback is another host's)."""
    from test_rank_debugger import Lab

    lab = Lab(k.client.km.connection_file)
    try:
        lab.start()
        cell = "%%dist --ranks 3\nx = rank * 2\ny = x + 1\nprint('y', y)\n"
        path = lab.break_at(cell, 3)
        msg_id = lab.kc.execute(cell)
        tid = lab.event("stopped", reason="breakpoint", timeout=60)["body"]["threadId"]
        threads = {t["id"]: t["name"] for t in lab.request("threads")["body"]["threads"]}
        assert threads[tid] == "rank 3", threads
        frame = lab.top(tid)
        assert frame["line"] == 3 and frame["source"]["path"] == path, frame
        assert lab.locals(frame["id"])["x"] == "6"
        lab.request("setBreakpoints", {"breakpoints": [], "source": {"path": path}})
        assert lab.request("continue", {"threadId": 1})["body"]["allThreadsContinued"]
        assert lab.reply(msg_id)["status"] == "ok"
        assert "[rank 3] y 7" in lab.streams.get(msg_id, "")
        relay = text_of(
            k.run(
                "%%dist --ranks 3\nfrom infini_notebook.engine import rank_debug\n"
                "print(*rank_debug._state['relay'].endpoint)"
            )
        )
        assert f"[rank 3] {hosts.addrs[1]} " in relay, relay  # not 127.0.0.1 of host b
    finally:
        lab.stop()


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


OWN_PROFILE = """\
%%dist
import os
from ipyparallel.engine.app import IPEngine
_folder = os.path.dirname(IPEngine.instance().profile_dir.location)
print("own" if _folder != {kernels!r} and "infini-notebook-" in _folder else _folder,
      "there" if os.path.exists(_folder) else "gone")
"""


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
        # Each engine's profile was in a folder of its own, not the kernel's, gone once its
        # rank was set up.
        kernels = text_of(k.run("print(dist_session.folder.path)")).strip()
        own = text_of(k.run(OWN_PROFILE.format(kernels=kernels)))
        assert "[rank 0] own gone" in own and "[rank 1] own gone" in own, own
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
    assert "NCCL_SOCKET_IFNAME" in script and "infini_notebook.engine.remote_start make" in script


def test_mpi_and_slurm_engines_need_no_file_from_the_kernel_host():
    """Other hosts lack the kernel's temporary profile dir: engines get the connection and
    the session's mark by environment (mpiexec forwards only what -x names) and make a
    folder of their own for their profile (remote_start "make")."""
    mpi = engine_options(make_plan(launcher="mpi", hosts="n1:2,n2:2", bind_address="10.0.0.5"))
    forwarded = {b for a, b in zip(mpi["mpi_args"], mpi["mpi_args"][1:]) if a == "-x"}
    assert {"IPP_CONNECTION_INFO", "IPP_CLUSTER_ID", "IPP_PROFILE_DIR"} <= forwarded
    slurm = engine_options(make_plan(launcher="slurm", nnodes=2, nprocs=2, bind_address="10.0.0.5"))
    for opts in (mpi, slurm):
        assert "--IPEngine.auto_create=True" in opts["engine_args"]
        assert opts["engine_cmd"][1:] == ["-m", "infini_notebook.engine.remote_start", "make"]
    assert "--export=ALL" in slurm["batch_template"]  # srun passes the whole environment
    ssh = engine_options(
        make_plan(launcher="ssh", hosts="n1:2", bind_address="10.0.0.5", remote_python="/py")
    )
    assert ssh["engine_cmd"] == ["/py", "-m", "infini_notebook.engine.remote_start", "check"]


# ----- a profile folder of the engine's own (issue 44.3) ------------------------------------


def _plant_profile(folder: str, marker: str) -> str:
    """As uid 65534: a profile folder with an engine config that leaves ``marker``."""
    os.makedirs(os.path.join(folder, "profile"), 0o777)
    with open(os.path.join(folder, "profile", "ipengine_config.py"), "w") as f:
        f.write(f"open({marker!r}, 'w').write('ran')\n")
    return "planted"


def _remote_start(mode: str, profile: str, tmpdir: str) -> subprocess.CompletedProcess:
    """An engine started as on another host, with no controller to find (it gives up at
    once): what it did with the profile folder it was given."""
    env = dict(os.environ, IPP_PROFILE_DIR=profile, TMPDIR=tmpdir)
    env.pop("IPP_CONNECTION_INFO", None)
    return subprocess.run(
        [sys.executable, "-m", "infini_notebook.engine.remote_start", mode]
        + ["--IPEngine.wait_for_url_file=0", "--IPEngine.auto_create=True"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def planted(tmp_path):
    """Another user's folder at a session's path in /tmp, with an engine config in its
    profile (and where that config would leave its mark)."""
    from other_user import as_other

    folder = f"/tmp/infini-notebook-planted{os.getpid()}{tmp_path.name[-8:]}"
    marker = os.path.join(folder, "ran")
    assert as_other(_plant_profile, folder, marker) == "planted"
    yield os.path.join(folder, "profile"), marker
    shutil.rmtree(folder)


@needs_root
def test_an_engine_refuses_a_profile_folder_it_does_not_own(planted, tmp_path):
    """ssh: the folder the kernel made must be this user's, mode 0700; another's is refused
    before ipengine reads its config."""
    profile, marker = planted
    out = _remote_start("check", profile, str(tmp_path))
    assert out.returncode == 2 and not os.path.exists(marker)
    assert "belongs to uid 65534" in out.stderr and "run %dist_start again" in out.stderr
    ours = tmp_path / "infini-notebook-ours"
    (ours / "profile").mkdir(parents=True)
    ours.chmod(0o755)
    out = _remote_start("check", str(ours / "profile"), str(tmp_path))
    assert out.returncode == 2 and "has mode 755, not 700" in out.stderr


@needs_root
def test_an_engine_makes_its_own_profile_folder_and_removes_it(planted, tmp_path):
    """mpiexec, Slurm: the session's folder path comes with the environment (another user
    may have made it on this host); the engine uses a new folder of its own instead."""
    profile, marker = planted
    out = _remote_start("make", profile, str(tmp_path))
    assert "connection file never arrived" in out.stderr, out.stderr[-2000:]
    assert profile not in out.stderr  # it looked in its own profile, not the planted one
    assert not os.path.exists(marker)  # the planted config never ran
    assert os.listdir(tmp_path) == []  # its own folder (made in TMPDIR) is gone with it


def test_what_makes_a_profile_folder_the_engines_own(tmp_path):
    from infini_notebook.engine import remote_start

    uid = os.geteuid()

    def st(mode, owner=uid):
        return os.stat_result((mode, 1, 1, 1, owner, 0, 0, 0, 0, 0))

    assert remote_start.folder_problem(st(0o040700), uid) is None
    assert "uid 65534" in remote_start.folder_problem(st(0o040700, 65534), uid)
    assert "mode 755" in remote_start.folder_problem(st(0o040755), uid)
    assert remote_start.folder_problem(st(0o040755), uid, private=False) is None
    assert "link" in remote_start.folder_problem(st(0o120777), uid)
    folder = tmp_path / "infini-notebook-x"
    folder.mkdir(0o700)
    os.environ[remote_start.FOLDER_ENV] = str(folder)
    assert remote_start.remove_own_folder() and not folder.exists()
    assert remote_start.FOLDER_ENV not in os.environ
    assert not remote_start.remove_own_folder()  # none (local engines)
    other = tmp_path / "someone-elses"
    other.mkdir(0o700)
    os.environ[remote_start.FOLDER_ENV] = str(other)
    assert not remote_start.remove_own_folder() and other.exists()  # not named as a session's


def test_ssh_hosts_and_the_folder_made_there():
    from infini_notebook.launch.ssh import made_folder, split_host

    assert split_host("alice@node1:2222") == ("alice@node1", "2222")
    assert split_host("node1") == ("node1", None)
    assert made_folder("Welcome!\n/tmp/infini-notebook-ab_12\n") == "/tmp/infini-notebook-ab_12"
    assert made_folder("/tmp/other") is None and made_folder("") is None


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
