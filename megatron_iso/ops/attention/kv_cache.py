"""A simple contiguous KV cache: per layer ``k, v`` of shape ``[slots, max_len, kv_heads, head_dim]``
plus per-slot lengths.

The attention kernels take explicit cache tensors and per-sequence start positions, not this object,
so a paged cache can later hand them its own views. Lengths advance once per model step (after
every layer has written and attended), which is why the kernels never touch ``lengths``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class KVCache:
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    lengths: torch.Tensor  # [slots] int64: tokens already cached per slot

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        slots: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        """Zero-filled cache (contents beyond a slot's length are never read: keys there are masked)."""
        shape = (slots, max_len, kv_heads, head_dim)
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            lengths=torch.zeros(slots, dtype=torch.int64, device=device),
        )

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def advance(self, slots: torch.Tensor | list[int], counts: torch.Tensor | list[int]) -> None:
        """Record that ``counts[j]`` tokens were appended to ``slots[j]`` (call once per model step)."""
        slots_t = torch.as_tensor(slots, dtype=torch.int64, device=self.lengths.device)
        counts_t = torch.as_tensor(counts, dtype=torch.int64, device=self.lengths.device)
        new = self.lengths[slots_t] + counts_t
        if bool((new > self.max_len).any()):
            raise ValueError(f"KV cache overflow: lengths {new.tolist()} exceed max_len {self.max_len}")
        self.lengths[slots_t] = new

    def reset(self, slot: int) -> None:
        """Free a slot for a new sequence (stale contents stay and are masked by the length)."""
        self.lengths[slot] = 0


@dataclass(frozen=True)
class PagedKVLayer:
    """One attention layer's paged KV pool as a block-table kernel reads and writes it (no staging copy).

    ``k_pool``/``v_pool``: ``[num_blocks, block_size, kv_heads, head_dim]``. ``block_tables``:
    ``[rows, width]`` int32/int64 on the pool's device; row ``r`` lists, in position order, the blocks
    of the sequence in cache slot ``r`` (entries past a sequence's length are never read).
    ``write_idx``: ``[T]`` int64, the flattened pool row (``block * block_size + offset``) of each new
    token in packed order: where the step's k/v are written before attention reads them.
    """

    k_pool: torch.Tensor
    v_pool: torch.Tensor
    block_tables: torch.Tensor
    write_idx: torch.Tensor

    @property
    def block_size(self) -> int:
        return int(self.k_pool.shape[1])


@dataclass
class KVStepPlan:
    """Host copy of one model step's cache layout, shared by every attention layer of the step.

    ``cu`` (token offsets, ``[n + 1]``), ``starts`` (tokens already cached per sequence) and
    ``slots`` (cache row per sequence) are what ``cu_seqlens_q``/``cache_seqlens``/``slots`` hold;
    whoever builds the step (``models.batch.pack``) knows them as Python lists, so the attention
    implementations need not read them back from the device (a host sync per tensor and layer on
    GPU). Device tensors derived from them (tile tables, write indices, masks) are built by the
    first layer that needs them and reused by the others (:meth:`memo`): a schedule/indexing
    input, never arithmetic, so the bits are those of building them per layer.
    """

    cu: list[int]
    starts: list[int]
    slots: list[int]
    # True for a captured decode step's static batch (``inference.cuda_graphs``): ``starts`` are
    # placeholders that give only the shape, the real positions change in ``cache_seqlens`` on the
    # device between replays. Only implementations that read positions on the device accept it.
    device_positions: bool = False
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.cu) - 1
        if n < 0 or self.cu[0] != 0 or any(b < a for a, b in zip(self.cu, self.cu[1:], strict=False)):
            raise ValueError(f"KVStepPlan: cu_seqlens must start at 0 and be non-decreasing, got {self.cu}")
        if len(self.starts) != n or len(self.slots) != n:
            raise ValueError(
                f"KVStepPlan: {n} sequences in cu but {len(self.starts)} starts and {len(self.slots)} slots"
            )

    @classmethod
    def from_tensors(
        cls, cu_seqlens_q: torch.Tensor, cache_seqlens: torch.Tensor, slots: torch.Tensor | None
    ) -> KVStepPlan:
        """The plan read back from the tensors (what a call without a plan does: syncs on GPU)."""
        starts = [int(s) for s in cache_seqlens.tolist()]
        return cls(
            [int(c) for c in cu_seqlens_q.tolist()],
            starts,
            list(range(len(starts))) if slots is None else [int(s) for s in slots.tolist()],
        )

    @property
    def lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.cu, self.cu[1:], strict=False)]

    def memo(self, key: object, build: Callable[[], Any]) -> Any:
        """``build()`` once per plan and ``key`` (the key names everything the value depends on besides the plan)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]


def resolve_plan(
    plan: KVStepPlan | None,
    q: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cache_seqlens: torch.Tensor,
    slots: torch.Tensor | None,
    *,
    reads_device_positions: bool = False,
) -> KVStepPlan:
    """The given plan (checked against q's token count) or one read back from the tensors.

    ``reads_device_positions``: the caller takes start positions from ``cache_seqlens`` on the device,
    so it may be given a ``device_positions`` plan (whose host ``starts`` are placeholders)."""
    if plan is None:
        plan = KVStepPlan.from_tensors(cu_seqlens_q, cache_seqlens, slots)
    if plan.device_positions and not reads_device_positions:
        raise ValueError(
            "a device_positions KVStepPlan (a captured decode step's buffers) holds placeholder starts; this "
            "attention implementation reads the host starts. Captured steps use the paged Triton kernel "
            "(correctness) or the native decode path (performance)."
        )
    if plan.cu[-1] != q.shape[0] or len(plan.cu) != cu_seqlens_q.numel():
        raise ValueError(
            f"cache_seqlens ({len(plan.starts)}) / cu_seqlens_q ({plan.cu}) do not match q ({q.shape[0]} tokens)"
        )
    return plan
