"""Source of notebooks/06_tensor_parallel_mlp.ipynb (run build.py to regenerate it)."""

from _nb import code, md, save

NAME = "06_tensor_parallel_mlp"

CELLS = [
    md("""
    # Tensor parallelism: an MLP split over the tp group

    Tensor parallelism (tp) splits each layer's weight matrices over a few ranks, so a layer
    too big for one GPU fits on several and they compute it together. The classic case is
    the transformer MLP, split the way Megatron-LM does it:

    - **fc1 column-parallel**: each rank keeps a slice of fc1's *output* features (rows of
      its weight). It computes its slice of the hidden activations, and the nonlinearity,
      which works element by element, stays local.
    - **fc2 row-parallel**: each rank keeps the matching slice of fc2's *input* features
      (columns of its weight), so its product is a partial sum of the output. One
      **all-reduce** over the tp group adds the partial sums.

    One all-reduce per MLP forward, and no rank ever holds the whole hidden layer. This
    notebook writes the two layers by hand, checks them against the unsplit model, then
    does the same with torch's tensor-parallel API on `mesh["tp"]`. About ten minutes, on 4
    CPU ranks; on GPUs start with `%dist_start --gpus 4 --tp 2` and nothing else changes.
    """),
    code("%load_ext infini_notebook"),
    md("""
    Four ranks with tp = 2 give two tp groups, ranks [0, 1] and [2, 3] (dp is the remaining
    2: each tp pair is one copy of the model). Every layer below is split over `groups.tp`.
    """),
    code("%dist_start --nprocs 4 --tp 2"),
    md("""
    ## The unsplit reference

    The same seed on every rank gives every rank the same weights and the same input, so
    each rank can check the split model against the whole one locally. `--collapse` shows
    identical output once: all four ranks agree.
    """),
    code("""
    %%dist --collapse
    import torch.nn as nn
    import torch.nn.functional as F

    class MLP(nn.Module):
        def __init__(self, dim=8, hidden=32):
            super().__init__()
            self.fc1 = nn.Linear(dim, hidden)
            self.fc2 = nn.Linear(hidden, dim)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x)))

    torch.manual_seed(0)  # same seed everywhere: same weights, same input
    ref = MLP().to(device)
    x = torch.randn(4, 8, device=device)
    ref_out = ref(x)
    print(f"fc1 {tuple(ref.fc1.weight.shape)}, fc2 {tuple(ref.fc2.weight.shape)}")
    print(f"output checksum {ref_out.sum().item():.6f}")
    """),
    md("""
    ## By hand: two layers and two tiny autograd functions

    The forward pass needs one collective, the backward pass one more. Megatron calls the
    pair **f** and **g**, each the other's mirror image:

    - **g**, after the row-parallel layer: all-reduce in the forward (add the partial sums),
      identity in the backward (every rank already has the whole output gradient).
    - **f**, before the column-parallel layer: identity in the forward (every rank already
      has the whole input), all-reduce in the backward (each rank's input gradient is a
      partial sum over its slice of hidden units).

    The layers keep their slice of a full `nn.Linear`, cut with `chunk`: rows (dim 0) for the
    column-parallel layer, columns (dim 1) for the row-parallel one. fc2's bias is added once,
    after the sum, so each rank keeps all of it.
    """),
    code("""
    %%dist
    class CopyToTP(torch.autograd.Function):  # f
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
            return grad, None


    class ReduceFromTP(torch.autograd.Function):  # g
        @staticmethod
        def forward(ctx, x, group):
            x = x.clone()
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad, None


    class ColumnParallelLinear(nn.Module):
        \"\"\"This rank's rows of the weight: a slice of the output features.\"\"\"

        def __init__(self, full: nn.Linear, group):
            super().__init__()
            n, i = dist.get_world_size(group), dist.get_rank(group)
            self.weight = nn.Parameter(full.weight.detach().chunk(n, dim=0)[i].clone())
            self.bias = nn.Parameter(full.bias.detach().chunk(n, dim=0)[i].clone())

        def forward(self, x):
            return F.linear(x, self.weight, self.bias)  # [batch, hidden / tp]


    class RowParallelLinear(nn.Module):
        \"\"\"This rank's columns of the weight: a slice of the input features.\"\"\"

        def __init__(self, full: nn.Linear, group):
            super().__init__()
            n, i = dist.get_world_size(group), dist.get_rank(group)
            self.group = group
            self.weight = nn.Parameter(full.weight.detach().chunk(n, dim=1)[i].clone())
            self.bias = nn.Parameter(full.bias.detach().clone())

        def forward(self, x_slice):
            partial = F.linear(x_slice, self.weight)  # [batch, dim], a partial sum
            return ReduceFromTP.apply(partial, self.group) + self.bias


    class TensorParallelMLP(nn.Module):
        def __init__(self, full: MLP, group):
            super().__init__()
            self.group = group
            self.fc1 = ColumnParallelLinear(full.fc1, group)
            self.fc2 = RowParallelLinear(full.fc2, group)

        def forward(self, x):
            x = CopyToTP.apply(x, self.group)
            return self.fc2(F.gelu(self.fc1(x)))
    """),
    md("""
    Split the reference over `groups.tp` and run the same input. Each rank holds half of
    fc1 and half of fc2 (fc2's small bias is kept whole), and the output matches the
    unsplit model to float rounding:
    """),
    code("""
    %%dist --collapse
    tp_mlp = TensorParallelMLP(ref, groups.tp)
    out = tp_mlp(x)
    assert torch.allclose(out, ref_out, atol=1e-6)

    n_tp, n_ref = (sum(p.numel() for p in m.parameters()) for m in (tp_mlp, ref))
    print(f"fc1 slice {tuple(tp_mlp.fc1.weight.shape)}, fc2 slice {tuple(tp_mlp.fc2.weight.shape)}")
    print(f"{n_tp} of {n_ref} parameters; max |out - ref| = {(out - ref_out).abs().max():.1e}")
    """),
    md("""
    The backward pass: each rank's weight gradients must equal its slice of the reference's
    gradients, and the input gradient (summed over the tp group by **f**) must equal the
    reference's whole:
    """),
    code("""
    %%dist --collapse
    def backward(model):
        model.zero_grad()
        xg = x.clone().requires_grad_()
        model(xg).pow(2).sum().backward()
        return xg.grad

    x_grad, ref_x_grad = backward(tp_mlp), backward(ref)
    def same(a, b):
        return torch.allclose(a, b, atol=1e-6)

    def my_slice(grad, dim):  # this rank's part of an unsplit gradient
        return grad.chunk(groups.tp_size, dim=dim)[groups.tp_rank]

    checks = {
        "fc1.weight": same(tp_mlp.fc1.weight.grad, my_slice(ref.fc1.weight.grad, 0)),
        "fc1.bias": same(tp_mlp.fc1.bias.grad, my_slice(ref.fc1.bias.grad, 0)),
        "fc2.weight": same(tp_mlp.fc2.weight.grad, my_slice(ref.fc2.weight.grad, 1)),
        "fc2.bias": same(tp_mlp.fc2.bias.grad, ref.fc2.bias.grad),
        "input": same(x_grad, ref_x_grad),
    }
    print("gradients match:", checks)
    """),
    md("""
    Take **f** out of `TensorParallelMLP.forward` and the `input` check fails: each rank would
    keep only its partial input gradient. The weight gradients do not need it.

    ## With torch's tensor-parallel API

    `torch.distributed.tensor.parallel` does the same with DTensors.
    `ColwiseParallel` shards a Linear's weight by rows (`Shard(0)`), `RowwiseParallel` by
    columns (`Shard(1)`), and `parallelize_module` inserts the collectives (the f and g
    above) in the module's forward and backward. It takes a 1-D `DeviceMesh`: the session's
    `mesh["tp"]`, which is the same communicator as `groups.tp`.

    A fresh model from the same seed has the reference's weights; parallelizing it shards
    them in place:
    """),
    code("""
    %%dist --collapse
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    torch_tp = parallelize_module(
        MLP().to(device), mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    )
    w1, w2 = torch_tp.fc1.weight, torch_tp.fc2.weight
    print(f"fc1.weight: {type(w1).__name__} {w1.placements}, local {tuple(w1.to_local().shape)}")
    print(f"fc2.weight: {type(w2).__name__} {w2.placements}, local {tuple(w2.to_local().shape)}")
    same_slices = torch.equal(w1.to_local(), tp_mlp.fc1.weight) and torch.equal(
        w2.to_local(), tp_mlp.fc2.weight
    )
    print("the same slices as by hand:", same_slices)
    """),
    md("""
    Same check as before, forward and backward. The weights' gradients are DTensors too;
    `full_tensor()` gathers one over the tp group, to compare with the unsplit gradient:
    """),
    code("""
    %%dist --collapse
    out = torch_tp(x)
    x_grad = backward(torch_tp)
    checks = {
        "output": same(out, ref_out),
        "fc1.weight": same(torch_tp.fc1.weight.grad.full_tensor(), ref.fc1.weight.grad),
        "fc2.weight": same(torch_tp.fc2.weight.grad.full_tensor(), ref.fc2.weight.grad),
        "input": same(x_grad, ref_x_grad),
    }
    print("torch TP matches the unsplit model:", checks)
    """),
    md("""
    ## The same cells as a torchrun script

    `%dist_export FILE.py` writes this session's `%%dist` cells, in order, as a script for
    `torchrun`. Each rank of the script gets the names and the parallel groups a rank has
    here (through `init_parallel_groups`), `--ranks` and `--where` become `if` guards, and
    every line is labeled `[rank N]`, so it prints what the cells above printed. What has no
    script equivalent is listed as skipped: failed cells, `%dist_pull`, and code that ran in
    the notebook itself, such as the two lines that pick a file name here.
    """),
    code("""
    import os, tempfile
    script = os.path.join(tempfile.mkdtemp(), "tp_mlp.py")
    %dist_export $script
    """),
    md("""
    The script starts like every rank here, then runs the cells (run it with
    `torchrun --nproc_per_node 4 tp_mlp.py`, or on GPUs as it is: the backend comes along):
    """),
    code("""
    with open(script) as f:
        print(f.read().split("# %%")[0])  # the part before the first cell
    """),
    md("""
    ## Debugging a tp bug by stepping into rank 1 while rank 0 waits

    Say the output of a tp layer came out wrong, and you suspect one rank's partial sum
    (a bias added before the all-reduce instead of after, say, counts it tp times). You want
    to stop rank 1 just before the all-reduce and look at its values, while rank 0 waits for
    it as it would in training. JupyterLab's own debugger does that on ranks; it needs
    clicks, so this part is to follow in JupyterLab (a headless run of this notebook just
    runs the cell below):

    1. Switch the debugger on: the bug icon at the right of the notebook's toolbar.
    2. Click the gutter left of line 5 of the cell below (`norm = partial.norm()`; the
       `%%dist` line counts as line 1, as in tracebacks): a red dot, and the Breakpoints
       panel lists it.
    3. Run the cell. Only rank 1 reaches line 5 and pauses there. The Callstack shows
       `rank 1: <module>` at the cell's line 5; Variables shows rank 1's own `h` and
       `partial` (its half of the hidden layer, its partial sum) and its namespace (`rank`
       is 1); the debug console evaluates on rank 1 (`partial.sum()`, `tp_mlp.fc2.weight`).
       Next steps rank 1 alone.
    4. Meanwhile rank 0 waits for rank 1 in the all-reduce, which is no hang: the cell's
       wait line says `rank 0 in the cell's 1st all_reduce (#1 on the tp group) at In[..],
       line 6; rank 1 paused in the debugger`, and a `%dist_status` shown earlier turns rank
       1's tile to `paused in the debugger`. Nothing is released. Ranks 2 and 3 (the other
       tp group) do not wait for rank 1: they finish and print.
    5. Continue (the play button of the Callstack panel): rank 1 runs on, the all-reduce
       completes and the cell prints as it does without the debugger.

    A breakpoint on a line of a module the ranks import pauses them the same way, once it
    is set on the module's own file: in the editor JupyterLab opens when a rank steps into
    the module, or from the Kernel Sources panel when the notebook imported it too
    (JupyterLab's plain file editor sets its breakpoints on a copy of the text, as for a
    cell, which no rank runs). A pause counts against the collective timeout (`%dist_start
    --timeout`, 300 s by default): raise it before a long look. Processes a rank starts
    while the debugger is on (a DataLoader's workers) run undebugged.
    """),
    code("""
    %%dist --collapse
    h = F.gelu(tp_mlp.fc1(x))  # this rank's slice of the hidden layer
    partial = F.linear(h, tp_mlp.fc2.weight)  # its partial sum of fc2's output
    if rank == 1:
        norm = partial.norm()  # line 5: a breakpoint here stops rank 1 alone
    dist.all_reduce(partial, group=groups.tp)  # rank 0 waits here for rank 1
    print("partial sums + bias == the unsplit output:", same(partial + tp_mlp.fc2.bias, ref_out))
    """),
    md("""
    An editor's debugger (VS Code) can attach to one rank instead: `%dist_debugpy --rank 1`
    prints the `attach` configuration to put in `launch.json`. Its port is the kernel's, on
    loopback, bridged to the rank's debugger over the session's signed link, and it lets in
    your own user only; ranks on other hosts are reached the same way. One debugger drives
    a rank at a time: attaching takes the rank from JupyterLab's.
    """),
    code("%dist_debugpy --rank 1"),
    code("%dist_stop"),
    md("""
    ## Recap

    - Column-parallel fc1 (rows of the weight) then row-parallel fc2 (columns) leaves the
      activation local and needs one all-reduce forward (**g**) and one backward (**f**).
    - By hand that is two `chunk` calls and two six-line autograd functions on `groups.tp`.
    - `parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2":
      RowwiseParallel()})` does the same with DTensors; `mesh["tp"]` and `groups.tp` are one
      communicator.
    - Checking against an unsplit model built from the same seed on every rank, forward and
      backward, catches a wrong split at once.
    - `%dist_export FILE.py` turns the cells into a script that `torchrun` runs the same way.
    - JupyterLab's debugger stops the ranks at a breakpoint of a `%%dist` cell, each rank a
      thread `rank N`; a rank paused there is said so while its tp peer waits for it.

    With dp = 2 here, ranks [0, 1] and [2, 3] are two copies of the model; a training step
    would feed each copy its own batch and average gradients over `groups.dp`
    (notebook 02 shows the groups).
    """),
]

if __name__ == "__main__":
    print(save(NAME, CELLS))
