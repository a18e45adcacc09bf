"""Source of notebooks/09_context_parallel.ipynb (run build.py to regenerate it)."""

from _nb import code, md

NAME = "09_context_parallel"

CELLS = [
    md("""
    # Context parallelism: ring attention over the cp group

    Context parallelism (cp) splits each *sequence* over the ranks of a cp group: with a
    long context, one rank cannot hold the activations of every token. Most of a transformer
    works token by token and splits for free; attention does not, because every query needs
    every key and value. **Ring attention** solves it: each rank keeps its block of queries,
    and the key/value blocks travel round the cp group as a ring. After cp steps every
    query block has met every key/value block, and no rank ever held more than two of them.

    The softmax over keys it never sees together is computed **blockwise**, the way flash
    attention does: per query, a running maximum `m` of the scores and a running sum `l` of
    their exponentials, and the output accumulated with the same scaling. When a new block
    raises the maximum, what was summed so far is rescaled by `exp(m_old - m_new)`.

    This notebook writes ring attention over `groups.cp`, using the layout's ring neighbours,
    checks its output and gradients against full attention in one process, then splits the
    heads over tp as well: tp × cp on 8 ranks. A few minutes, on 8 CPU ranks; on GPUs start
    with `%dist_start --gpus 8 --tp 2 --cp 4` and nothing else changes.
    """),
    code("%load_ext infini_notebook"),
    md("""
    Eight ranks, tp = 2 and cp = 4. With the default order (`tp-cp-dp-pp`, fastest first)
    the cp groups are the ranks with the same tp coordinate: [0, 2, 4, 6] and [1, 3, 5, 7].
    `groups.cp_send_to` and `groups.cp_recv_from` are each rank's neighbours on its ring (global
    ranks, as `dist.isend` and `dist.irecv` want them):
    """),
    code("%dist_start --nprocs 8 --tp 2 --cp 4"),
    code("""
    %%dist
    print(f"cp group {groups.ranks_in('cp')}, block {groups.cp_rank}: "
          f"send to {groups.cp_send_to}, receive from {groups.cp_recv_from}")
    """),
    md("""
    ## Full attention, in one process

    Queries, keys and values for 4 heads, 32 tokens, 16 features per head, the same on every
    rank from the same seed, so each rank can compute the whole attention itself: the
    reference. The gradients come from a made-up loss, the sum of the outputs times fixed
    random weights `w`.
    """),
    code("""
    %%dist --collapse
    import torch.nn.functional as F

    torch.manual_seed(0)
    heads, tokens, dim = 4, 32, 16
    q, k, v = (torch.randn(heads, tokens, dim, device=device) for _ in range(3))
    w = torch.randn(heads, tokens, dim, device=device)  # the loss is (out * w).sum()

    def full_attention(q, k, v):
        scores = q @ k.transpose(-1, -2) / dim**0.5  # [heads, tokens, tokens]
        return torch.softmax(scores, dim=-1) @ v

    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out = full_attention(ref_q, ref_k, ref_v)
    (ref_out * w).sum().backward()
    print("reference output", tuple(ref_out.shape), f"checksum {ref_out.sum().item():.3f}")
    """),
    md("""
    ## One step round the ring

    A rank sends its block to `cp_send_to` and receives the next one from `cp_recv_from`,
    both at once (`batch_isend_irecv`), so the whole ring moves one step. For the backward
    pass the same function sends the gradient the other way: the gradient of a block belongs
    to the rank the block came from. Keys and values travel stacked as one tensor, so every
    rank runs its steps, forward and backward, in the same order.
    """),
    code("""
    %%dist
    class RingStep(torch.autograd.Function):
        \"\"\"Pass a block one step round the cp ring; its gradient goes one step back.\"\"\"

        @staticmethod
        def forward(ctx, block):
            return exchange(block, to=groups.cp_send_to, source=groups.cp_recv_from)

        @staticmethod
        def backward(ctx, grad):
            return exchange(grad, to=groups.cp_recv_from, source=groups.cp_send_to)

    def exchange(block, to, source):
        block, received = block.contiguous(), torch.empty_like(block)
        ops = [
            dist.P2POp(dist.isend, block, to, groups.cp),
            dist.P2POp(dist.irecv, received, source, groups.cp),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        return received

    got = RingStep.apply(torch.tensor([float(rank)], device=device))
    print(f"rank {rank} got the block of rank {int(got.item())}")
    """),
    md("""
    Each rank got the block of its `cp_recv_from`, within its own cp group.

    ## Ring attention

    Each rank takes its block of the sequence (`chunk` over the token dim, block `cp_rank`)
    of q, k and v. Then cp times: score its queries against the key/value block it holds,
    fold them into the running max `m`, sum `l` and output `acc`, and pass the block on. The
    maximum only keeps the exponentials in range; the result does not depend on it, so it is
    detached (no gradient flows through it).
    """),
    code("""
    %%dist --collapse
    def ring_attention(q, k, v):
        \"\"\"This rank's query block attending to the whole sequence, held by the cp group.\"\"\"
        m = torch.full(q.shape[:-1], float("-inf"), device=q.device)  # running max per query
        l = torch.zeros(q.shape[:-1], device=q.device)  # running sum of exp(score - m)
        acc = torch.zeros_like(q)  # running sum of exp(score - m) @ v
        kv = torch.stack([k, v])
        for step in range(groups.cp_size):
            scores = q @ kv[0].transpose(-1, -2) / q.shape[-1] ** 0.5
            m_new = torch.maximum(m, scores.amax(dim=-1)).detach()
            p = torch.exp(scores - m_new[..., None])
            rescale = torch.exp(m - m_new)  # what was summed so far, at the new max
            l = l * rescale + p.sum(dim=-1)
            acc = acc * rescale[..., None] + p @ kv[1]
            m = m_new
            if step < groups.cp_size - 1:
                kv = RingStep.apply(kv)
        return acc / l[..., None]

    def my_block(t):
        return t.chunk(groups.cp_size, dim=-2)[groups.cp_rank]

    cp_q, cp_k, cp_v = (my_block(t).clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(cp_q, cp_k, cp_v)
    (out * my_block(w)).sum().backward()
    print(f"this rank: {tuple(cp_q.shape[-2:])} queries and keys of {tuple(q.shape[-2:])}")
    """),
    md("""
    ## The check against full attention

    Each rank's output must be its block of the full output, and the gradients of its q, k
    and v blocks its blocks of the reference gradients (a key's gradient collects
    contributions from every query block: they came back round the ring). Within
    `atol=1e-5` (float32, sums in another order):
    """),
    code("""
    %%dist --collapse
    def same(a, b):
        return torch.allclose(a, b, rtol=1e-5, atol=1e-5)

    checks = {
        "output": same(out, my_block(ref_out)),
        "dq": same(cp_q.grad, my_block(ref_q.grad)),
        "dk": same(cp_k.grad, my_block(ref_k.grad)),
        "dv": same(cp_v.grad, my_block(ref_v.grad)),
    }
    print("ring attention matches full attention:", checks)
    """),
    md("""
    Every rank of both cp groups agrees. Each rank held at most 2 of the 4 key/value blocks
    at a time, and the scores it computed were a quarter of the full [32, 32] matrix per
    head: that is what lets the context grow with the number of cp ranks. (Real
    implementations also start passing the next block before computing on the current one,
    so the transfer hides behind the compute, and with a causal mask they balance the blocks
    so that no rank idles.)

    ## tp × cp: heads over tp, the sequence over cp

    Attention heads are independent, so tensor parallelism splits them: each tp rank takes
    half of the heads (`chunk` over dim 0, block `tp_rank`), and runs the same ring
    attention over its cp group on those heads only. Each of the 8 ranks then holds
    2 heads × 8 tokens: an eighth of q, k and v. The check is the same, on the
    (heads, tokens) block of the reference:
    """),
    code("""
    %%dist --collapse
    def my_heads(t):
        return t.chunk(groups.tp_size, dim=0)[groups.tp_rank]

    def my_tile(t):  # this rank's heads (tp) and tokens (cp)
        return my_block(my_heads(t))

    tq, tk, tv = (my_tile(t).clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(tq, tk, tv)
    (out * my_tile(w)).sum().backward()
    checks = {
        "output": same(out, my_tile(ref_out)),
        "dq": same(tq.grad, my_tile(ref_q.grad)),
        "dk": same(tk.grad, my_tile(ref_k.grad)),
        "dv": same(tv.grad, my_tile(ref_v.grad)),
    }
    print(f"heads {groups.tp_rank * heads // 2}-{groups.tp_rank * heads // 2 + 1}, tokens "
          f"{groups.cp_rank * 8}-{groups.cp_rank * 8 + 7}: {tuple(tq.shape)} of {tuple(q.shape)}")
    print("tp x cp attention matches full attention:", checks)
    """),
    md("""
    The ring attention code did not change: the heads it receives are this tp rank's, and the
    ring is its cp group, which `groups.cp` already is for every tp coordinate. In a full
    attention layer the q, k and v projections would be column-parallel over tp, producing
    just these heads, and the output projection row-parallel (notebook 06).
    """),
    code("%dist_stop"),
    md("""
    ## Recap

    - Ring attention: each cp rank keeps its query block; key/value blocks pass round the
      ring (`groups.cp_send_to`, `groups.cp_recv_from`) in cp steps.
    - Blockwise softmax: a running max and sum per query, earlier sums rescaled by
      `exp(m_old - m_new)` when the max grows; the max needs no gradient.
    - One autograd function makes the ring differentiable: the gradient goes one step back
      round the same ring.
    - tp × cp: heads over tp, tokens over cp, the same code. Output and gradients match full
      attention in one process within `atol=1e-5`.
    """),
]
