"""Source of notebooks/08_pipeline_parallel.ipynb (run build.py to regenerate it)."""

from _nb import code, md

NAME = "08_pipeline_parallel"

CELLS = [
    md("""
    # Pipeline parallelism: stages over the pp group, GPipe and 1F1B

    Pipeline parallelism (pp) cuts the model by depth: each rank of a pp group holds a few
    consecutive layers, a **stage**, and activations flow from stage to stage (gradients flow
    back). One batch alone would keep one stage busy at a time, so the batch is cut into
    **micro-batches** that follow each other through the stages, and the **schedule** says in
    which order each stage runs the forward (F) and backward (B) passes of its micro-batches:

    - **GPipe**: all forwards, then all backwards. Simple; each stage keeps the activations of
      every micro-batch until its backward.
    - **1F1B**: after a warm-up, each stage alternates one forward and one backward, so it
      keeps at most (number of stages) micro-batches' activations alive.

    This notebook splits a small model over `groups.pp` with `torch.distributed.pipelining`,
    runs both schedules, draws each one's timeline from what the stages record, and checks
    the loss and the gradients against the unsplit model. A few minutes, on 4 CPU ranks; on
    GPUs start with `%dist_start --gpus 4 --pp 4` and nothing else changes.
    """),
    code("%load_ext infini_notebook"),
    md("""
    Four ranks, pp = 4: one pipeline of four stages. `groups.pp_rank` is a rank's stage,
    and `groups.pp_prev` / `groups.pp_next` are the global ranks it receives from and sends
    to (None at the ends).
    """),
    code("%dist_start --nprocs 4 --pp 4"),
    code("""
    %%dist
    print(f"stage {groups.pp_rank} of {groups.pp_size}: from {groups.pp_prev}, to {groups.pp_next}")
    """),
    md("""
    ## The model, whole, and its stages

    Eight blocks of `Linear` + `Tanh`, the same on every rank from the same seed. The whole
    model's loss and gradients on the whole batch are the reference. Each rank then keeps
    its two blocks (a copy: the reference keeps its own gradients) as its stage's module:
    """),
    code("""
    %%dist --collapse
    import copy
    import time

    import torch.nn as nn

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(8)]
    whole = nn.Sequential(*blocks).to(device)
    x = torch.randn(128, 512, device=device)  # a batch of 128 samples
    y = torch.randn(128, 512, device=device)
    loss_fn = nn.MSELoss()

    ref_loss = loss_fn(whole(x), y)
    ref_loss.backward()
    print(f"one-process loss {ref_loss.item():.4f}")

    per_stage = len(whole) // groups.pp_size
    first = groups.pp_rank * per_stage
    block_ids = list(range(first, first + per_stage))
    module = copy.deepcopy(whole[first : first + per_stage])
    ref_grads = [p.grad for p in whole[first : first + per_stage].parameters()]
    module.zero_grad(set_to_none=True)
    """),
    md("""
    `--where pp=0` runs a cell only on the ranks whose pp coordinate is 0: here the first
    stage, to look at one stage's module without four copies of the output:
    """),
    code("""
    %%dist --where pp=0
    print("blocks", block_ids, "of", len(whole))
    print(module)
    """),
    md("""
    ## A stage and a schedule

    `PipelineStage(module, stage_index, num_stages, device, group=groups.pp)` sends its
    outputs to the next stage of the group and receives its inputs from the previous one.
    A schedule runs micro-batches through it: `step(x)` on the first stage (which cuts the
    batch into micro-batches), `step(target=y, losses=...)` on the last (which computes the
    loss of each micro-batch), `step()` in between.

    To draw the timeline, each stage records when it runs each micro-batch's forward and
    backward: `forward_one_chunk` and `backward_one_chunk` are the stage's methods the
    schedules call, one micro-batch each, and `record` wraps them with a clock.
    """),
    code("""
    %%dist --collapse
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    def record(stage, events):
        \"\"\"Log (pass, micro-batch, start, end) of every F and B this stage runs.\"\"\"
        def timed(kind, run):
            def wrapper(chunk, *args, **kwargs):
                start = time.time()
                out = run(chunk, *args, **kwargs)
                events.append((kind, chunk, start, time.time()))
                return out
            return wrapper
        stage.forward_one_chunk = timed("F", stage.forward_one_chunk)
        stage.backward_one_chunk = timed("B", stage.backward_one_chunk)

    def run_step(schedule):
        \"\"\"One training step of the pipeline; the last stage gets each micro-batch's loss.\"\"\"
        losses = []
        if groups.is_first_stage:
            schedule.step(x)
        elif groups.is_last_stage:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        return losses

    def check(losses):
        \"\"\"Loss (on the last stage) and this stage's gradients against the whole model.\"\"\"
        pairs = zip(module.parameters(), ref_grads)
        same_grads = all(torch.allclose(p.grad, g, rtol=1e-5, atol=1e-6) for p, g in pairs)
        if groups.is_last_stage:
            loss = torch.stack(losses).mean()  # equal micro-batches: the mean of the means
            same_loss = torch.allclose(loss, ref_loss, rtol=1e-5)
            print(f"loss {loss.item():.4f}, matches one process: {same_loss}")
        print(f"stage {groups.pp_rank}: gradients match one process: {same_grads}")
    """),
    md("""
    ## GPipe

    Eight micro-batches of 16 samples. Each stage's gradients are the sum over micro-batches
    of the gradients of each micro-batch's mean loss, which the schedule divides by the
    number of micro-batches (`scale_grads=True`): the gradients of the whole batch's mean
    loss. Look for `True` on every stage, checked within `rtol=1e-5, atol=1e-6` (sums taken
    in another order round differently):
    """),
    code("""
    %%dist
    gpipe_events = []
    stage = PipelineStage(module, groups.pp_rank, groups.pp_size, device, group=groups.pp)
    record(stage, gpipe_events)
    gpipe = ScheduleGPipe(stage, n_microbatches=8, loss_fn=loss_fn)
    check(run_step(gpipe))
    """),
    md("""
    ## The timeline

    `timed_step` runs one more step (gradients zeroed first: the first step of a stage also
    infers the shapes it will exchange, so it is not the one to time) and sends each stage's
    log to stage 0 (`gather_object` over `groups.pp`), which prints the order of the passes
    per stage. `draw` makes one row per stage: blue boxes are forwards, orange boxes
    backwards, numbered by micro-batch.
    """),
    code("""
    %%dist --collapse
    import matplotlib.pyplot as plt

    def timed_step(schedule, events):
        \"\"\"One recorded step; stage 0 gets every stage's log and prints the order.\"\"\"
        module.zero_grad(set_to_none=True)
        events.clear()
        run_step(schedule)
        logs = [None] * groups.pp_size if groups.is_first_stage else None
        dist.gather_object(events, logs, dst=groups.ranks_in("pp")[0], group=groups.pp)
        for stage_id, log in enumerate(logs or []):
            print(f"stage {stage_id}:", " ".join(f"{kind}{mb}" for kind, mb, _, _ in log))
        return logs

    def draw(logs, title):
        t0 = min(start for log in logs for _, _, start, _ in log)
        fig, ax = plt.subplots(figsize=(8, 2.2))
        for stage_id, log in enumerate(logs):
            for kind, mb, start, end in log:
                left, width = 1e3 * (start - t0), 1e3 * (end - start)  # ms
                color = "tab:blue" if kind == "F" else "tab:orange"
                ax.broken_barh([(left, width)], (stage_id - 0.4, 0.8), color=color)
                ax.text(left + width / 2, stage_id, str(mb), ha="center", va="center", fontsize=8)
        ax.set(yticks=range(groups.pp_size), ylabel="stage", xlabel="ms", title=title)
        ax.invert_yaxis()
        plt.show()

    gpipe_logs = timed_step(gpipe, gpipe_events)
    """),
    md("""
    Only stage 0 holds the logs, so it alone draws (`--where pp=0`):
    """),
    code("""
    %%dist --where pp=0
    draw(gpipe_logs, "GPipe: all forwards, then all backwards")
    """),
    md("""
    Look at the staircase: stage 0 starts the forward of micro-batch 1 as soon as it has
    sent micro-batch 0 on, and the backwards run in the other direction, from the last stage
    to the first. The empty corners are the **pipeline bubble**, idle time that shrinks
    relative to the work as micro-batches are added. The printed order above is what to
    compare with 1F1B (the times vary from run to run; the order does not).

    ## 1F1B

    Same stage module, a new `PipelineStage`, `Schedule1F1B`, and the same checks:
    """),
    code("""
    %%dist
    module.zero_grad(set_to_none=True)
    f1b1_events = []
    stage = PipelineStage(module, groups.pp_rank, groups.pp_size, device, group=groups.pp)
    record(stage, f1b1_events)
    f1b1 = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    check(run_step(f1b1))
    """),
    code("""
    %%dist --collapse
    f1b1_logs = timed_step(f1b1, f1b1_events)
    """),
    code("""
    %%dist --where pp=0
    draw(f1b1_logs, "1F1B: one forward, one backward")
    """),
    md("""
    The last stage now runs `F0 B0 F1 B1 ...`: each micro-batch's backward follows its
    forward at once, stage 2 starts with two forwards, stage 0 with four (as many as there
    are stages from it to the end). The bubble is the same as GPipe's; what changes is
    memory: a stage holds the activations of at most that many micro-batches, where GPipe
    holds all eight.

    To see one stage's log alone, `--where pp=N` again, here the last stage:
    """),
    code("""
    %%dist --where pp=3
    for kind, mb, start, end in f1b1_events:
        print(f"{kind} micro-batch {mb}: {1e3 * (end - start):.2f} ms")
    """),
    code("%dist_stop"),
    md("""
    ## Recap

    - A stage is a rank's slice of the layers, `PipelineStage(module, groups.pp_rank,
      groups.pp_size, device, group=groups.pp)`; the pp group connects it to its neighbours
      (`groups.pp_prev`, `groups.pp_next`).
    - `ScheduleGPipe` and `Schedule1F1B` run micro-batches through the stages; the first
      stage passes the batch, the last the targets and gets the micro-batch losses.
    - With equal micro-batches, the mean of their losses and the scaled gradients equal the
      whole batch's (checked within `rtol=1e-5`).
    - The timeline from each stage's own record shows the schedule: GPipe's all-F-then-all-B,
      1F1B's alternation, and the bubble both share.
    - `%%dist --where pp=0` looks at one stage.
    """),
]
