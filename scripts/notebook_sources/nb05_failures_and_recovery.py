"""Source of notebooks/05_failures_and_recovery.ipynb (run build.py to regenerate it)."""

from _nb import code, md

NAME = "05_failures_and_recovery"

CELLS = [
    md("""
    # Failures and recovery: exceptions, hangs, interrupts, dead ranks

    Distributed code fails in more ways than ordinary code: one rank raises while the others
    carry on, a collective waits forever for a rank that never comes, a rank dies. In a
    script you read four log files and restart the job. Here each failure is a failed cell
    that says **which ranks** failed, **how**, and **what to type next**, and your variables
    usually survive. This notebook walks through each failure on purpose:

    | failure | what the cell says | recovery |
    |---|---|---|
    | exception on one rank | that rank's traceback, labeled | none needed |
    | a rank fails, others wait | its traceback at once; the waits released | none: groups rebuilt |
    | hung collective, no failure | where each rank waits, live; timeout ends it | `%dist_restart` |
    | you press stop | SIGINT to every rank; the ranks waiting released | none: groups rebuilt |
    | a rank dies | the rank, its exit code or signal; peers released | `%dist_restart --ranks N` |

    Cells that fail on purpose carry the tag `raises-exception`, so *Run All* goes on past
    them. About ten minutes, on 4 CPU ranks; on GPUs start with `--gpus 4` instead.
    """),
    code("%load_ext infini_notebook"),
    md("""
    `--timeout 5` sets the collective timeout to 5 seconds (the default is 300). A real job
    wants minutes, because a slow rank is not a dead one; a tutorial wants hangs to end
    fast.
    """),
    code("%dist_start --nprocs 4 --tp 2 --timeout 5"),
    md("""
    A variable on every rank, to check later which failures keep the ranks' state:
    """),
    code("""
    %%dist
    keep = rank * 100
    print("keep =", keep)
    """),
    md("""
    ## 1. An exception on one rank

    Rank 2 divides by zero; the others finish. The cell fails (so *Run All* would stop here)
    and shows the rank's own traceback under its label, then one summary line: which ranks
    failed with what, and which finished. Output printed before the error still shows.
    """),
    code(
        """
    %%dist
    scale = 1 / (rank - 2)
    print(f"rank {rank}: scale {scale:+.2f}")
    """,
        "raises-exception",
    ),
    md("""
    To look inside the failure, `%dist_debug CODE` runs code on each rank that failed in the
    last cell, in the frame where it raised: the innermost frame of your own code, so inside
    a function you wrote it sees that function's local variables. Only rank 2 failed here,
    so only rank 2 answers (`%%dist_debug` takes several lines as a cell):
    """),
    code('%dist_debug print(f"rank {rank}: rank - 2 = {rank - 2}, keep = {keep}")'),
    md("""
    ### Stepping through a rank live

    With no code, `%dist_debug --ranks 2` opens pdb itself in that frame, at the notebook's
    input box: the prompt reads `[rank 2] (Pdb)`; `p keep`, `up`, `c` or `q` as usual.
    The same box serves code running in a cell: `input()`, `breakpoint()` and
    `torch.distributed.breakpoint(rank=1)` on a rank ask there, one prompt at a time, each
    labeled with its rank, after what the rank printed before asking. Meanwhile the other
    ranks wait (in `torch.distributed.breakpoint`'s barrier): `%dist_status` shows rank 1
    `at a prompt`, and nothing counts as hung or is released. In JupyterLab:

    ```
    %%dist
    x = rank * 10
    torch.distributed.breakpoint(rank=1)
    print('after', rank, x)
    ```
    ```
    [rank 0] after 0 0
    [rank 1] > In[12](2)<module>()
    [rank 1] -> torch.distributed.breakpoint(rank=1)
    [rank 1] (Pdb) p x + 1
    [rank 1] 11
    [rank 1] (Pdb) c
    [rank 1] after 1 10
    ```

    pdb starts in the cell's frame, at the breakpoint's line, so the cell's names are there
    at once (torch's own function is a frame below; stepping passes over it).

    `q` instead of `c` fails the cell on rank 1 in one line, `rank 1: left the debugger
    (q)`, releases rank 0 and rebuilds the groups, as for any failed rank; the Stop button
    at a prompt does the same. The collective timeout still bounds the wait of the other
    ranks: `torch.distributed.breakpoint` raises it to an hour itself, and `%dist_start
    --timeout` sets it for the session. This notebook was executed headless (nbclient has
    no input box), where a rank that asks gets `StdinNotImplementedError` saying so, so the
    session above is shown, not run.

    Nothing else is damaged: no collective was involved, so the process groups are fine and
    the next cell just runs. `%dist_status` marks rank 2 as `failed` until its next cell
    succeeds.
    """),
    code("%dist_status"),
    code("""
    %%dist
    print("still fine, keep =", keep)
    """),
    md("""
    ## 2. One rank fails while the others wait for it

    The most common failure in distributed code: one rank raises (a shape mismatch, a bug in
    a rank-dependent branch) and the others block in the next collective, waiting for a peer
    that will never come. Rank 0 raises here; ranks 1-3 go on into `all_reduce`.

    Look at three things: rank 0's traceback appears at once, while the others still wait;
    the error starts with that root cause, then says who was waiting for whom, where (the
    cell's 1st `all_reduce`, its number in the world group beside it, the line of this cell)
    and that the wait was
    **released**; and the cell ends in about a second, not at the timeout. Only waits that
    can never finish are released: a rank computing, or waiting in a group without the
    failed rank, is left alone.
    """),
    code(
        """
    %%dist
    if rank == 0:
        raise RuntimeError("rank 0 bails out")
    dist.all_reduce(torch.ones(1))
    """,
        "raises-exception",
    ),
    md("""
    The process groups the released ranks used were rebuilt by themselves (a soft restart:
    new groups under a fresh store prefix, same processes), so `groups` and `mesh` are new
    and your variables are kept. Objects you built on the old groups (a DDP or FSDP module,
    your own `DeviceMesh`) must be made again. The next cell just works:
    """),
    code("""
    %%dist
    y = torch.ones(1)
    dist.all_reduce(y)
    print(f"all_reduce works: {y.item():.0f}; keep = {keep}")
    """),
    md("""
    The same holds when the peers did not fail but simply **finished** without entering the
    collective, the classic "not every rank reaches it" bug: rank 0 waits for ranks that
    already left the cell, so its wait is released too.
    """),
    code(
        """
    %%dist
    x = torch.ones(1)
    if rank == 0:          # the bug: only one rank enters the collective
        dist.all_reduce(x)
    print("done", rank)
    """,
        "raises-exception",
    ),
    md("""
    ## 3. A genuine hang: every rank waits, in collectives that do not match

    When no rank has left the cell, nobody can tell a slow rank from a stuck one, so the
    collective timeout (5 s here) decides. Meanwhile, after two seconds, the cell shows,
    updated in place, where each rank waits: the call, which of the cell's calls it is, its
    group and its number there from torch's Flight Recorder. Ranks 0-1 are in `all_reduce`,
    ranks 2-3 in `broadcast`, both the world group's collective #N: a mismatch.
    """),
    code(
        """
    %%dist
    x = torch.ones(1)
    if rank < 2:
        dist.all_reduce(x)
    else:
        dist.broadcast(x, 0)
    """,
        "raises-exception",
    ),
    md("""
    After a timeout the process groups cannot be trusted: a rank may have half-sent data,
    and the next collective could pair with the leftover. `%dist_restart` rebuilds them: every
    rank destroys its process groups and initialises new ones under a fresh store prefix
    (so no stale key from the broken attempt is read), in the **same** engine processes.
    Your variables stay.
    """),
    code("%dist_restart"),
    code("""
    %%dist
    y = torch.ones(1)
    dist.all_reduce(y)
    print(f"all_reduce works again: {y.item():.0f}; keep = {keep}")
    """),
    md("""
    ## 4. Where is each rank? `%dist_stacks`

    `%dist_stacks` prints each rank's Python stack *now*. A small thread on each rank takes
    it (`faulthandler`) and sends it back through the session's TCPStore, so it works even
    while the rank is busy in a cell or blocked inside a collective, when a cell could not
    reach it, and for ranks on other hosts. Most recent call first.
    On an idle rank it just says so (`--all-threads` shows every thread's frames anyway):
    """),
    code("%dist_stacks --ranks 0"),
    md("""
    To look at ranks *while* a cell runs, run that cell with `--background`: it returns at
    once, its output fills in below it as the ranks print, and the notebook is free for
    other cells. Here rank 0 enters an `all_reduce` while ranks 1-3 compute for 6 s (longer
    than the 5 s timeout), and `%dist_status` and `%dist_stacks` look at it meanwhile:
    """),
    code("""
    %%dist --background
    import time
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # the others come too late
    else:
        time.sleep(6)
    print("rank", rank, "finished its part")
    """),
    code("""
    import time

    time.sleep(1)  # let the ranks get going
    %dist_status
    """),
    md("""
    All four ranks are busy. Rank 0's stack shows where it waits: the top
    frame is `all_reduce` in `torch/distributed/distributed_c10d.py`, the last one the line
    of the cell that called it (`File "/tmp/ipykernel_.../....py", line 3 in <module>`):
    """),
    code("%dist_stacks --ranks 0"),
    md("""
    After the timeout the background cell shows rank 0's error (in its own output area,
    above), and the process groups need the same soft restart as in section 3:
    """),
    code("""
    while any(r.state == "busy" for r in dist_session.status()):
        time.sleep(0.2)
    print(dist_session.last.errors)
    %dist_restart
    """),
    md("""
    Without `--background`, pressing stop ends the cell and frees the ranks that waited for
    the ones it stopped (section 5).

    ## 5. Interrupting a cell

    Pressing Jupyter's stop button sends SIGINT to the kernel. `%%dist` passes it on: every
    rank running the cell gets SIGINT, Python raises `KeyboardInterrupt` there, and the
    cell ends within a moment with `KeyboardInterrupt`. The ranks stay alive and keep their
    variables.

    A headless run has no button to press, so `press_stop` below presses it for us: a timer
    thread sends SIGINT to this kernel process a moment later, the same signal the button
    sends. (The kernel only treats SIGINT as an interrupt while a cell runs, so the timer is
    armed in the same cell as the code it interrupts; that is why the next cell uses
    `dist_session.run(...)`, the Python API behind `%%dist`, instead of the cell magic.)
    """),
    code("""
    import os, signal, threading

    def press_stop(after=2.0):
        \"\"\"Send this kernel SIGINT in `after` seconds, as Jupyter's stop button does.\"\"\"
        threading.Timer(after, os.kill, (os.getpid(), signal.SIGINT)).start()
    """),
    md("""
    Every rank sleeps for a minute; the stop "button" is pressed after 2 s, and the cell ends
    right after with `KeyboardInterrupt`:
    """),
    code(
        """
    press_stop(after=2.0)
    dist_session.run(\"\"\"
    import time
    print("sleeping for a minute...")
    time.sleep(60)
    \"\"\")
    """,
        "raises-exception",
    ),
    md("""
    The ranks caught the `KeyboardInterrupt`, ended the cell, and kept their variables:
    """),
    code("""
    %%dist
    print("awake, keep =", keep)
    """),
    md("""
    ### Ranks waiting for a stopped rank

    Python reacts to a signal only between bytecodes. A rank blocked in native code (a
    collective waiting for its peers, a long CUDA synchronize) cannot raise
    `KeyboardInterrupt` until that call returns. Here rank 0 is in an `all_reduce` while the
    others sleep; the stop button ends the sleepers. They leave the cell as ranks that
    raised, so rank 0, waiting for them, is released as in section 4, and the process
    groups are rebuilt: one line says who stopped and who waited where, and the variables
    are kept.
    """),
    code(
        """
    press_stop(after=1.0)
    dist_session.run(\"\"\"
    import time
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(30)
    \"\"\")
    """,
        "raises-exception",
    ),
    code("""
    %%dist
    y = torch.ones(1)
    dist.all_reduce(y)
    print(f"sum {y.item():.0f}, keep = {keep}")
    """),
    md("""
    A rank that neither stops nor waits for a rank that left (native code that ignores the
    signal and holds no collective) is named in one line after 3 s; `%dist_stacks` shows
    where it is. It stays busy until it returns, or until the collective timeout; cells
    that need it are refused, naming it, and `%dist_restart --ranks N` replaces it alone
    (section 6).
    """),
    md("""
    ## 6. A dead rank

    A rank can die outright: killed for using too much memory, a segfault in an extension, a
    CUDA error that takes down the process. Here rank 2 exits with status 7 while the others
    head into an `all_reduce` that now can never complete. The session watches the engine
    processes, so the cell does not wait for the timeout: within a second it fails, naming
    rank 2 and its exit code (or the signal that killed it), and releases the survivors
    that were waiting for it (ranks that were computing would finish their work).
    """),
    code(
        """
    %%dist
    import os, time
    if rank == 2:
        os._exit(7)          # dies without a word: no exception, no traceback
    time.sleep(0.5)
    dist.all_reduce(torch.ones(1))
    """,
        "raises-exception",
    ),
    md("""
    `%dist_status` shows the dead rank (in a live notebook these tiles update by themselves
    while cells run; a static render shows the state at the time):
    """),
    code("%dist_status"),
    md("""
    A soft restart cannot bring a process back to life, so it refuses and names the fix.
    (Running a `%%dist` cell now would refuse the same way.)
    """),
    code("%dist_restart", "raises-exception"),
    md("""
    `%dist_restart --ranks 2` starts a new engine for rank 2 alone, forked from the session's
    warm template (torch already imported), and makes every rank's process groups anew. The
    other ranks keep their processes and everything they hold; the new rank 2 starts with an
    empty namespace (`%dist_heal` gives it what a replica in its dp group holds).
    """),
    code("%dist_restart --ranks 2"),
    code("""
    %%dist
    y = torch.ones(1)
    dist.all_reduce(y)
    print(f"sum {y.item():.0f}; 'keep' still defined: {'keep' in globals()}")
    """),
    md("""
    `%dist_restart --hard` stops every engine and starts new ones: the spares the template
    forked while the session was idle (one per rank; `%dist_status` counts them), or new
    forks, so it takes a second at most. Everything the ranks held is gone: variables,
    models, optimizer state. Save what you cannot recompute (`%dist_pull`, or `torch.save`
    on the ranks) before you need it.
    """),
    code("%dist_restart --hard"),
    code("""
    %%dist
    print(f"'keep' still defined: {'keep' in globals()}")
    """),
    md("""
    ## 7. When the kernel itself dies

    Restarting or shutting down the kernel ends the session's processes, and so does a
    kernel that is killed outright (SIGKILL, the out-of-memory killer): each engine watches
    the kernel process and exits when it is gone, and a small watchdog process ends the
    controller and any engine left over. Everything the session started is gone within
    seconds: no orphaned ranks holding GPU memory or ports. Only processes the session
    started itself (checked by pid and start time) are ever signalled.

    `%dist_stop` ends the session now:
    """),
    code("%dist_stop"),
    md("""
    ## Summary

    - **Exception on some ranks**: the cell fails with each rank's traceback labeled; the
      session is fine, run the next cell.
    - **A rank fails while others wait for it**: its traceback shows at once, the waits that
      can never finish are released within a second or so, and the process groups are
      rebuilt by themselves (variables kept; re-create DDP/FSDP modules and meshes).
    - **Hung collective, nobody failed**: the cell shows where each rank waits after two
      seconds; start with a `--timeout` that suits your job. When it fires, `%dist_restart`
      rebuilds the process groups and keeps every variable.
    - **`%dist_stacks`**: where every rank is now, even inside a collective.
    - **Stop button**: SIGINT to every rank; the ranks waiting in a collective for one that
      stopped are released and the groups rebuilt (variables kept); a rank that ignores it
      is named in one line (`%dist_stacks` shows where).
    - **Dead rank**: named with its exit code within a second, its waiting peers released;
      `%dist_restart --ranks N` starts a new rank N and the others keep their variables;
      `%dist_restart --hard` starts fresh engines for every rank.
    - **Kernel gone**: every process of the session ends within seconds.
    """),
]
