"""Token logprob / log-sum-exp over vocab shards in Triton (GPU correctness profile).

Same algorithm as ``reference.VocabScores``: ``z = logits.float() / t`` (correctly rounded division),
``m = max z`` (exact in any order), per vocab *leaf* ``s_l = sum exp(z - m)``, leaves added with the fixed
balanced tree (:func:`megatron_iso.ops.common.tree.tree_sum_dim`), ``lse = m + log(s)``, ``logp = z_target - lse``.

One program per (row, shard); within a leaf the sum is a BLOCK-lane fp32 accumulator walked over the
leaf's blocks from its start, then ``tl.sum`` (fixed block and warps): a leaf's sum depends only on the
leaf's values, never on which shard holds it or on how many rows share the launch, so batch and
vocab-parallel (TP) invariance both hold. With one shard the max and the sums run in one program (the
row is re-read from L2); with several shards the global max is taken first (a max, so exact).
Signature matches ``reference.token_logprobs_shards``.

Not registered as the CUDA correctness ``logprob`` implementation: scoring (``parallel.vocab_scoring``)
needs a backward, entropy and the full log-softmax, which this forward-only kernel does not provide yet,
so CUDA runs ``reference.VocabScores`` (elementwise torch ops + the tree, invariant on the GPU too) and
the contract says so. Wiring it in means a scores class around this kernel with ``with_plain_backward``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from megatron_iso.ops.common.tree import tree_sum_dim
from megatron_iso.ops.logprob.reference import temperature_rows

BLOCK = 2048
NUM_WARPS = 8
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _vocab_kernel(
    x_ptr, t_ptr, m_ptr, s_ptr, T, V_SHARD, LEAF, VALID, stride_c, stride_t,
    LOCAL_LEAVES: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # MODE 0: write the shard's row max to m[shard, row]. MODE 1: read the global max m[row], write leaf sums.
    # MODE 2: one shard, max then sums in the same program.
    row = tl.program_id(0).to(tl.int64)
    shard = tl.program_id(1)
    base = x_ptr + shard.to(tl.int64) * stride_c + row * stride_t
    temp = tl.load(t_ptr + row)
    offs = tl.arange(0, BLOCK)
    vbase = shard * V_SHARD  # global vocab id of this shard's first entry
    if MODE == 1:
        m = tl.load(m_ptr + row)
    else:
        mv = tl.full((BLOCK,), float("-inf"), tl.float32)
        for start in range(0, V_SHARD, BLOCK):
            idx = start + offs
            ok = (idx < V_SHARD) & (vbase + idx < VALID)
            z = tl.math.div_rn(tl.load(base + idx, mask=ok, other=float("-inf")).to(tl.float32), temp)
            mv = tl.maximum(mv, tl.where(ok, z, float("-inf")))
        m = tl.max(mv, axis=0)
        if MODE == 0:
            tl.store(m_ptr + shard.to(tl.int64) * T + row, m)
    if MODE != 0:
        for leaf in tl.static_range(LOCAL_LEAVES):
            acc = tl.zeros((BLOCK,), tl.float32)
            for start in range(0, LEAF, BLOCK):
                idx = leaf * LEAF + start + offs
                ok = (start + offs < LEAF) & (vbase + idx < VALID)
                z = tl.math.div_rn(tl.load(base + idx, mask=ok, other=0.0).to(tl.float32), temp)
                acc += tl.where(ok, tl.exp(z - m), 0.0)
            tl.store(
                s_ptr + row * (LOCAL_LEAVES * tl.num_programs(1)) + shard * LOCAL_LEAVES + leaf, tl.sum(acc, axis=0)
            )
        if MODE == 2:
            tl.store(m_ptr + row, m)


def vocab_stats_triton(
    shards: Sequence[torch.Tensor], *, temperature=1.0, leaves: int = 8, valid_vocab: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row max ``m`` [rows], per-leaf sums [rows, leaves] and temperature per row, for C shards [..., V/C]."""
    if len(shards) == 0:
        raise ValueError("need at least one vocab shard")
    x = torch.stack(list(shards), dim=0)
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"token_logprobs_triton: unsupported dtype {x.dtype}; supported {SUPPORTED_DTYPES}")
    C, shard = x.shape[0], x.shape[-1]
    if leaves < 1 or leaves & (leaves - 1) or leaves < C or leaves % C:
        raise ValueError(f"token_logprobs_triton: leaves={leaves} must be a power of two >= the {C} shards")
    local = leaves // C
    if shard % local:
        raise ValueError(f"token_logprobs_triton: vocab shard {shard} is not divisible by its {local} leaves")
    x = x.reshape(C, -1, shard).contiguous()
    T = x.shape[1]
    vocab = shard * C
    valid = vocab if valid_vocab is None else int(valid_vocab)
    if not 0 < valid <= vocab:
        raise ValueError(f"valid_vocab={valid_vocab} outside (0, {vocab}]")
    t = temperature_rows(temperature, T, x.device)
    s = torch.empty((T, leaves), device=x.device, dtype=torch.float32)
    common = dict(LOCAL_LEAVES=local, BLOCK=BLOCK, num_warps=NUM_WARPS)
    if C == 1:
        m = torch.empty((T,), device=x.device, dtype=torch.float32)
        _vocab_kernel[(T, 1)](x, t, m, s, T, shard, shard // local, valid, x.stride(0), x.stride(1), MODE=2, **common)
    else:
        mc = torch.empty((C, T), device=x.device, dtype=torch.float32)
        _vocab_kernel[(T, C)](x, t, mc, s, T, shard, shard // local, valid, x.stride(0), x.stride(1), MODE=0, **common)
        m = mc.amax(dim=0)
        _vocab_kernel[(T, C)](x, t, m, s, T, shard, shard // local, valid, x.stride(0), x.stride(1), MODE=1, **common)
    return m, s, t


def token_logprobs_triton(
    shards: Sequence[torch.Tensor] | torch.Tensor,
    target_ids: torch.Tensor,
    *,
    temperature=1.0,
    leaves: int = 8,
    valid_vocab: int | None = None,
) -> torch.Tensor:
    """fp32 log-probability of each row's target; ``shards`` are C contiguous vocab shards in rank order
    (a single tensor is one shard)."""
    if isinstance(shards, torch.Tensor):
        shards = [shards]
    m, s, t = vocab_stats_triton(shards, temperature=temperature, leaves=leaves, valid_vocab=valid_vocab)
    lead = shards[0].shape[:-1]
    shard = shards[0].shape[-1]
    ids = target_ids.reshape(-1).to(m.device).long()
    if ids.numel() != m.numel():
        raise ValueError(f"target_ids shape {tuple(target_ids.shape)} != logits rows {tuple(lead)}")
    if bool(((ids < 0) | (ids >= shard * len(shards))).any()):
        raise ValueError(f"target id outside [0, {shard * len(shards)})")
    owner = ids // shard
    local = ids - owner * shard
    x = torch.stack([sh.reshape(-1, shard) for sh in shards], dim=0)
    picked = x[owner, torch.arange(ids.numel(), device=ids.device), local].float()
    lse = m + torch.log(tree_sum_dim(s, -1))
    return (picked / t - lse).reshape(lead)


def vocab_parallel_check(logits: torch.Tensor, target_ids: torch.Tensor, temperature, leaves: int, world: int) -> bool:
    """True if ``world`` contiguous vocab shards give the same bits as one shard (TP invariance)."""
    one = token_logprobs_triton([logits], target_ids, temperature=temperature, leaves=leaves)
    many = token_logprobs_triton(list(logits.chunk(world, dim=-1)), target_ids, temperature=temperature, leaves=leaves)
    return bool(torch.equal(one.view(torch.int32), many.view(torch.int32)))
