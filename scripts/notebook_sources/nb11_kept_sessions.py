"""Source of notebooks/11_kept_sessions.ipynb (run build.py to regenerate it)."""

from _nb import code, md

NAME = "11_kept_sessions"

CELLS = [
    md("""
    # Sessions that outlive their kernel

    A model that took ten minutes to load over eight GPUs should not die with a kernel that
    crashed, was restarted, or went with a laptop that slept. Give the session a name and
    say how long it may wait for a kernel, and it outlives its kernel: the ranks with their
    variables, the process groups and the mesh, the store, and a cell that was running. Any
    new kernel of yours on the same machine attaches it. This notebook runs on two CPU ranks
    and takes about a minute.
    """),
    code("%load_ext infini_notebook"),
    md("""
    ## A kept session

    `--name` names it (unique for you on this machine) and `--keep` says how long it waits
    once no kernel drives it (`90s`, `10m`, `2h`); after that it ends itself completely:
    every process, its folder and its shared memory. Without `--keep` nothing changes: a
    session ends with its kernel.
    """),
    code("%dist_start --nprocs 2 --name tutorial-kept --keep 10m"),
    md("A small data-parallel model, trained for a while: this is what we want to keep."),
    code("""
    %%dist
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.randn(256, 8).chunk(world_size)[rank]  # each rank its own shard
    target = (data**2).sum(1, keepdim=True)  # more than a line can fit: the loss stays

    def train(steps):
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(data), target)
            loss.backward()
            for p in model.parameters():  # DDP by hand: average the gradients
                dist.all_reduce(p.grad)
                p.grad /= world_size
            opt.step()
        return loss.item()

    step = 100
    print(f"step {step}: loss {train(step):.4f}")
    """),
    md("""
    ## Restart the kernel

    Now use **Kernel > Restart** (or let the kernel crash). Jupyter signals the kernel's
    whole process group; none of the session's processes is in it, so they stay. (The next
    cell is tagged `restart-kernel-before`: when this notebook is run headless, its runner
    restarts the kernel there exactly as Jupyter does.)

    In the new kernel nothing of the old one is left, not even the extension.
    `%dist_sessions` lists your kept sessions: who drives each, or for how long it still
    waits for a kernel (it is also a DataFrame: `df = %dist_sessions`).
    """),
    code(
        """
        %load_ext infini_notebook
        %dist_sessions
        """,
        "restart-kernel-before",
    ),
    md("""
    ## Attach it

    `%dist_attach` takes the session over. One line says what it took: its ranks, backend,
    age, and whether it was detached or taken from another kernel. The training cell above
    finished while no kernel was attached: the line names it (ok or failed, and when), shows
    the last lines each rank printed, and makes it `session.last`; `%dist_export` has it as
    code. A rank that died while detached, or a cell that still runs (with where its output
    goes), would be named here too.
    """),
    code("%dist_attach tutorial-kept"),
    md("The model, the optimizer and the process groups are where they were; training goes on:"),
    code("""
    %%dist
    step += 20
    print(f"step {step}: loss {train(20):.4f}, weights still {model.weight.shape}")
    """),
    md("""
    ## One kernel at a time

    A second kernel's `%dist_attach tutorial-kept` is refused in one line that names the
    kernel driving it (its pid, since when); `%dist_attach tutorial-kept --force` takes it
    over, and the kernel that lost it says so at its next command. `%dist_status`,
    `%dist_stacks`, `%dist_interrupt` and `%dist_export` work as in any session, the
    export with the cells of every kernel that drove it.

    A cell that was running when its kernel went keeps running. Everything it printed, with
    or without a kernel attached, is in the session's per-rank output files
    (`output/rank0.stdout`, named by the attach line).

    `%dist_detach` lets the session go and keeps it (its keep time starts counting);
    `%dist_stop` ends it from the kernel that drives it; `%dist_stop NAME` ends any of your
    kept sessions from any kernel, without attaching.
    """),
    code("%dist_stop"),
]
