"""A simple contiguous KV cache: per layer ``k, v`` of shape ``[slots, max_len, kv_heads, head_dim]``
plus per-slot lengths.

The attention kernels take explicit cache tensors and per-sequence start positions, not this object,
so a paged cache can later hand them its own views. Lengths advance once per model step (after
every layer has written and attended), which is why the kernels never touch ``lengths``.
"""

from __future__ import annotations

from dataclasses import dataclass

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
