"""Source of notebooks/04_stores_and_init_methods.ipynb (run build.py to regenerate it)."""
# ruff: noqa: E501  (markdown tables are notebook text)

from _nb import code, md, save

NAME = "04_stores_and_init_methods"

CELLS = [
    md("""
    # Stores and init methods: how ranks find each other

    Before the first collective, the ranks of a job must *rendezvous*: agree on how many they
    are, who is rank 0, and swap the addresses they will connect to. torch.distributed does
    this through a **store**, a small key-value service every rank can reach. Each init
    method (`env://`, `tcp://`, `file://`) is just a way to get one.

    This notebook shows the three stores (TCPStore, PrefixStore, FileStore) on live ranks,
    builds a process group by hand from a store among ranks of your choosing (the way two
    separately launched replicas can join one group), and compares the init methods side by
    side. About ten minutes, on 4 and then 2 CPU ranks.
    """),
    code("%load_ext infini_notebook"),
    md("""
    ## Four ranks, `env://`

    `env://` is the default, the one torchrun uses: every rank reads `MASTER_ADDR`,
    `MASTER_PORT`, `RANK` and `WORLD_SIZE` from its environment. The session hosts the
    TCPStore in this notebook's kernel (like torchrun's agent, it outlives any rank) and sets
    those variables on each rank:
    """),
    code("%dist_start --nprocs 4"),
    code("""
    %%dist
    import os
    " ".join(f"{k}={os.environ[k]}" for k in ["MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"])
    """),
    md("""
    ## TCPStore

    A TCPStore is one server and one client per process, a dict over TCP. Its operations
    block, which is what makes it useful for coordination:

    | call | does |
    |---|---|
    | `set(key, value)` | store bytes (str is encoded) |
    | `get(key)` | the value, **waiting** until the key exists (up to the timeout) |
    | `wait([keys])` | block until every key exists |
    | `add(key, n)` | atomic counter: add n, return the new value |
    | `check([keys])`, `list_keys()`, `compare_set`, `delete_key` | look without waiting, compare-and-swap, remove |

    Each rank connects its own client to the kernel's server, at the address in its
    environment. Rank 0 writes a key; the others wait for it:
    """),
    code("""
    %%dist
    from datetime import timedelta

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
        is_master=False, timeout=timedelta(seconds=30),
    )
    if rank == 0:
        store.set("greeting", "hello from rank 0")
    store.wait(["greeting"])  # ranks 1-3 block here until rank 0 has set it
    store.get("greeting")
    """),
    md("""
    `add` is atomic, so four ranks adding 1 each get 1, 2, 3 and 4, in the order they
    happened to arrive (it changes from run to run). That is enough for a barrier: the last
    rank to arrive opens the door, the others wait for it. torch's own store-based barriers
    work much the same way.
    """),
    code("""
    %%dist
    arrived = store.add("arrived", 1)
    if arrived == world_size:
        store.set("door", "open")
    store.wait(["door"])
    f"arrived as number {arrived}; the door is open"
    """),
    md("""
    The server lives in this kernel, so the notebook can read the store too. Bring the port
    back from rank 0 with `%dist_pull` and connect a client here:
    """),
    code("""
    %%dist --ranks 0
    port = int(os.environ["MASTER_PORT"])
    """),
    code("""
    %dist_pull port --ranks 0
    import torch.distributed as dist

    kernel_store = dist.TCPStore("127.0.0.1", port[0], is_master=False)
    kernel_store.get("greeting"), kernel_store.add("arrived", 0)  # add 0 reads a counter
    """),
    md("""
    ## PrefixStore

    One store serves everything, so keys need namespaces. `PrefixStore(prefix, store)` puts
    `prefix/` in front of every key, so code that uses the same key names can share a store
    without collisions. Ranks 0 and 2 form team 0, ranks 1 and 3 team 1; both count their
    members under the same key, `size`:
    """),
    code("""
    %%dist
    team = dist.PrefixStore(f"team_{rank % 2}", store)
    team.set(f"member_{rank}", "here")
    team.add("size", 1)  # each team's own counter: 1, then 2
    """),
    code("""
    keys = sorted(kernel_store.list_keys())
    root = f"infini-{dist_session.rendezvous.token}/"  # the session's keys: see below
    session_keys = [k for k in keys if k.startswith(root)]
    print(len(session_keys), "keys under the session's root, in",
          sorted({k[len(root):].split("/")[0].split("-")[0] for k in session_keys}))
    print("our keys:", [k for k in keys if not k.startswith(root)])
    print("team_0/size =", kernel_store.get("team_0/size"))
    print("team_1/size =", kernel_store.get("team_1/size"))
    """),
    md("""
    The session's own keys live under one root, `infini-` and 32 random hex digits, so
    that no other user of the machine can guess them. Its default process group was created
    with `init_process_group(store=PrefixStore(".../attempt_0-NONCE", store), ...)`, so all
    of torch's rendezvous traffic (each rank's address, the groups' barrier counters) lives
    under that prefix; `infini/` holds the stack requests and telemetry. `%dist_restart`
    (for a failed collective) builds the groups again, keeping your variables, under
    `attempt_1` and a fresh random nonce on the same store, so the new groups can never
    read a stale address left by the old ones, nor keys someone wrote there in advance:
    """),
    code("%dist_restart"),
    code("""
    from collections import Counter

    Counter(
        k[len(root):].split("-")[0] for k in kernel_store.list_keys()
        if k.startswith(root + "attempt_")
    )
    """),
    md("""
    The rule for your own groups is the same: **one fresh prefix per group instance.**

    ## FileStore

    Same API, backed by a file that every rank opens: no server and no open port, only a
    file system all ranks share (one machine, or NFS between machines). Choose the path here
    and push it to the ranks:
    """),
    code("""
    import os
    import tempfile

    fs_path = os.path.join(tempfile.mkdtemp(), "filestore")
    %dist_push fs_path
    """),
    code("""
    %%dist --collapse
    fstore = dist.FileStore(fs_path, world_size)
    fstore.add("count", 1)
    dist.barrier()  # every rank has added
    print(f"{int(fstore.get('count'))} ranks counted in {fs_path}, {os.path.getsize(fs_path)} bytes")
    """),
    md("""
    ## A process group straight from a store

    Picture two replicas of a training job, **launched separately**: each has its own
    torchrun, its own default group, its own `new_group` calls. Now rank 0 of replica A and
    rank 0 of replica B must average something (a loss, a checksum, weights), a
    cross-replica all-reduce. `dist.new_group` cannot do it: it only makes subgroups of one
    default group. But a process group needs no more than a store, a rank and a size:

        pg = dist.ProcessGroupGloo(store, rank_in_group, group_size)   # ProcessGroupNCCL alike

    Both sides connect to one agreed store and pick one prefix for the group. Here ranks 0-1
    play replica A and ranks 2-3 replica B; local rank 0 of each replica forms one pair,
    local rank 1 the other, both on the same store at once, kept apart by their prefixes:
    """),
    code("""
    %%dist
    replica, local = divmod(rank, 2)  # replica A: ranks 0, 1; replica B: ranks 2, 3
    pair_store = dist.PrefixStore(f"cross_replica/local_{local}", store)
    pair = dist.ProcessGroupGloo(pair_store, replica, 2)  # rank in the pair: the replica

    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=pair)
    {"replica": "AB"[replica], "pair rank": pair.rank(), "pair size": pair.size(), "sum": t.item()}
    """),
    md("""
    Pair (0, 2) sums to 2 and pair (1, 3) to 4. Such a group is unknown to
    torch.distributed's registry (so ask `pair.rank()`, not `dist.get_rank(pair)`), but
    collectives take it. Each member wrote its address under the group's prefix:
    """),
    code('sorted(k for k in kernel_store.list_keys() if k.startswith("cross_replica"))'),
    md("""
    To re-create a pair (say replica B restarted), use a new prefix such as
    `cross_replica/local_0/attempt_1`; with the old one the newcomer would read the old
    addresses and try to connect to a process that is gone.

    The other side need not be a rank of this session at all. Below, a plain Python process
    started from the notebook (a stand-in for a separately launched job) joins rank 0 in a
    group of two, through the same store:
    """),
    code("""
    import subprocess
    import sys

    outsider = f'''
    import torch, torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", {port[0]}, is_master=False)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("outsider_pair", store), 1, 2)
    t = torch.tensor([100.0])
    dist.all_reduce(t, group=pg)
    print("outsider: sum", t.item())
    del pg  # before the interpreter exits: gloo torn down at exit can abort (exit code -6)
    '''
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", outsider], env=env, stdout=subprocess.PIPE, text=True
    )
    """),
    code("""
    %%dist --ranks 0
    pg = dist.ProcessGroupGloo(dist.PrefixStore("outsider_pair", store), 0, 2)
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=pg)
    print("rank 0: sum", t.item())
    """),
    code("""
    out, _ = proc.communicate(timeout=60)
    print(out.strip(), "| exit code", proc.returncode)
    """),
    code("%dist_stop"),
    md("""
    ## Init methods side by side

    `init_process_group(init_method=URL)` turns the URL into a store, then builds the group
    on it. What each needs and where each fits (after torch's
    [documentation](https://pytorch.org/docs/stable/distributed.html#initialization)):

    | | `env://` (default) | `tcp://HOST:PORT` | `file:///PATH` |
    |---|---|---|---|
    | store | TCPStore at `MASTER_ADDR:MASTER_PORT` | TCPStore at HOST:PORT | FileStore at PATH |
    | each rank needs | `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE` in its env | the URL, plus `rank=` and `world_size=` | the URL, plus `rank=` and `world_size=` |
    | who serves | rank 0 (torchrun: its agent) | rank 0 listens on PORT | nobody: a file |
    | requires | a free port on rank 0's host, reachable by all | the same, and its address known in advance | a file system every rank shares, with `fcntl` locking; the file must not exist (or be empty) |
    | fits | launchers that set the env: torchrun, Slurm, Kubernetes | your own launcher that knows rank 0's host | no open ports between hosts, but a shared NFS |

    In a script, the three look like this (a fourth, `store=`, takes any store you made,
    which is what this tool does under its `attempt_N-NONCE` prefix):

    ```python
    dist.init_process_group("gloo")  # env://: torchrun has set the four variables
    dist.init_process_group("gloo", init_method="tcp://10.0.0.1:23456", rank=rank, world_size=4)
    dist.init_process_group("gloo", init_method="file:///mnt/shared/rendezvous", rank=rank, world_size=4)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4)
    ```

    `%dist_start --init-method` takes the same URLs. For `tcp://` the kernel serves the
    store on the port you give, so pick a free one (IPython expands `{free_port}` in a magic
    line):
    """),
    code("""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free_port = sock.getsockname()[1]
    free_port
    """),
    code("%dist_start --nprocs 2 --init-method tcp://127.0.0.1:{free_port}"),
    code("""
    %%dist --collapse
    import os
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    print(f"store at {address}, all_reduce gives {t.item():.0f}")
    """),
    code("%dist_stop"),
    md("""
    For `file://` the path needs three slashes (`file://` + `/tmp/...`), must not exist yet,
    and lives in a folder every rank can reach:
    """),
    code("""
    init_file = os.path.join(tempfile.mkdtemp(), "rendezvous")
    %dist_start --nprocs 2 --init-method file://{init_file}
    %dist_push init_file
    """),
    code("""
    %%dist --collapse
    import os
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    print(f"store file exists: {os.path.exists(init_file)}, all_reduce gives {t.item():.0f}")
    """),
    code("%dist_stop"),
    md("""
    A leftover file breaks the next rendezvous on the same path (torch tries to delete it
    when the processes exit, and leaves it to you when that fails); `%dist_stop` removes it:
    """),
    code("os.path.exists(init_file)"),
    md("""
    ## Recap

    - A **store** is how ranks rendezvous: `set`, blocking `get`/`wait`, atomic `add`.
      TCPStore needs a reachable port, FileStore a shared file system.
    - **PrefixStore** gives each user of a store its own key space. The session uses
      `infini-TOKEN/attempt_N-NONCE/`; use one fresh prefix per group you build.
    - **Init methods** are ways to get a store: `env://` (launchers), `tcp://` (known host and
      port), `file://` (shared file system), or `store=` directly.
    - A **process group from a store**, `dist.ProcessGroupGloo(PrefixStore(name, store),
      rank, size)`, joins any processes that can reach the store, even separately launched
      jobs, for a cross-replica all-reduce.
    """),
]

if __name__ == "__main__":
    print(save(NAME, CELLS))
