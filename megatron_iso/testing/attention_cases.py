"""Decode-step cases of the Triton attention for the interpreter checks (tests/ops/test_attention_split_interpret.py,
tests/ops/test_attention_park_interpret.py): the one recipe for their pack, its training forward, and the same
sequences' last tokens as a decode step from a contiguous cache or a paged pool, each output held bit for bit
(bit patterns) to the training forward at the sequences' last positions.

The pack's lengths (:data:`LENS`) sit on both sides of the 64-key blocks and the 128-key segments. The inputs are
drawn from one seeded generator in a fixed order (q, k, v, gate, cache slots, then each paged pool's block table
as it is built), so a case draws the same numbers wherever it runs. Call it in the interpreted child process.
"""

from __future__ import annotations

import torch

from megatron_iso.ops.attention import attention_triton as at
from megatron_iso.ops.attention import forward_launch_triton as launch
from megatron_iso.ops.attention.forward_launch_triton import AttentionTileConfig
from megatron_iso.ops.attention.kv_cache import KVStepPlan, PagedKVLayer
from megatron_iso.testing.bits import bit_difference, same_bits

LENS = (1, 63, 64, 65, 127, 128, 129, 300)  # both sides of the 64-key blocks and 128-key segments
CACHE_CAPACITY = 320  # keys per contiguous cache slot (past the longest sequence: NaN)
PAGED_CAPACITY = 512  # keys per paged block-table row: a table wider than the longest sequence (a static capacity)
GATES = ("none", "dim", "head")


class DecodeCase:
    """The pack of :data:`LENS` with ``group`` query heads per kv head, ``hkv`` kv heads, head dim ``d`` and
    ``gate`` (none / dim: per element / head: one per head), drawn from ``seed``; ``train`` its one-launch
    training forward, ``want`` that at each sequence's last position. A decode step computes those last tokens
    with their earlier keys in a cache (:meth:`contiguous`, :meth:`paged`); :meth:`check` holds it to ``want``."""

    def __init__(self, group: int, hkv: int, gate: str, d: int, seed: int) -> None:
        if gate not in GATES:
            raise ValueError(f"DecodeCase: gate={gate!r} must be one of {GATES}")
        assert launch.SEG_BLOCKS * 64 == 128, "the lengths straddle 128-key segments"
        self.d, self.n, self.hkv = d, len(LENS), hkv
        self.gen = torch.Generator().manual_seed(seed)
        self.cu = [0]
        for n in LENS:
            self.cu.append(self.cu[-1] + n)
        t, hq = self.cu[-1], group * hkv
        self.q, self.k, self.v = (torch.randn(t, h, d, generator=self.gen) for h in (hq, hkv, hkv))
        # Both gates drawn whatever ``gate`` is, so the draws after them do not depend on it.
        gates = {"dim": torch.randn(t, hq, d, generator=self.gen), "head": torch.randn(t, hq, 1, generator=self.gen)}
        self.gate = gates.get(gate)
        self.train = at.attention_varlen(self.q, self.k, self.v, torch.tensor(self.cu), gate=self.gate, split=False)
        assert not torch.isnan(self.train).any()
        last = [c - 1 for c in self.cu[1:]]
        self.want = self.train[last]
        self.step = [x[last].contiguous() for x in (self.q, self.k, self.v)]
        self.gate_step = None if self.gate is None else self.gate[last].contiguous()
        self.starts = [n - 1 for n in LENS]
        self.slots = torch.randperm(self.n, generator=self.gen).tolist()  # cache rows in another order
        self.cu_step = torch.arange(self.n + 1)
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def check(self, got: torch.Tensor, what: object) -> None:
        """``got`` has ``want``'s bits; else fail naming ``what`` and where the bits differ."""
        assert same_bits(got, self.want), (what, bit_difference(got, self.want))

    def contiguous(self, config: AttentionTileConfig | None = None, split: bool | None = None) -> torch.Tensor:
        """The decode step from a contiguous cache (each sequence's earlier keys in its slot, NaN past them), on a
        fresh copy of the cache."""
        if self._cache is None:
            kc = torch.full((self.n, CACHE_CAPACITY, self.hkv, self.d), float("nan"))
            vc = kc.clone()
            for i, (a, n) in enumerate(zip(self.cu[:-1], LENS, strict=True)):
                kc[self.slots[i], : n - 1] = self.k[a : a + n - 1]
                vc[self.slots[i], : n - 1] = self.v[a : a + n - 1]
            self._cache = kc, vc
        kc, vc = self._cache
        return at.attention_with_kv_cache(
            *self.step, kc.clone(), vc.clone(), torch.tensor(self.starts), self.cu_step,
            slots=torch.tensor(self.slots), gate=self.gate_step, config=config, split=split,
        )  # fmt: skip

    def paged_layer(self, page: int) -> PagedKVLayer:
        """A paged pool of ``page``-key blocks holding each sequence's earlier keys in shuffled blocks (two spare),
        NaN where nothing was written; its write rows are the last tokens'. Draws the table from the case's
        generator."""
        width = -(-PAGED_CAPACITY // page)
        blocks = width * self.n + 2
        table = torch.randperm(blocks, generator=self.gen)[: width * self.n].view(self.n, width).contiguous()
        kp = torch.full((blocks, page, self.hkv, self.d), float("nan"))
        vp = kp.clone()
        write = []
        for i, (a, n) in enumerate(zip(self.cu[:-1], LENS, strict=True)):
            j = torch.arange(n)
            rows = table[self.slots[i]][j // page] * page + j % page
            kp.view(-1, self.hkv, self.d)[rows[:-1]] = self.k[a : a + n - 1]
            vp.view(-1, self.hkv, self.d)[rows[:-1]] = self.v[a : a + n - 1]
            write.append(int(rows[-1]))
        return PagedKVLayer(kp, vp, table, torch.tensor(write))

    def paged(
        self,
        layer: PagedKVLayer,
        placeholder: bool,
        config: AttentionTileConfig | None = None,
        split: bool | None = None,
    ) -> torch.Tensor:
        """The decode step from ``layer`` (:meth:`paged_layer`) under a step plan with real host starts, or
        (``placeholder``) zeros with the positions on the device, as a captured decode graph's plan has."""
        plan = KVStepPlan(
            list(range(self.n + 1)), [0] * self.n if placeholder else self.starts, self.slots,
            device_positions=placeholder,
        )  # fmt: skip
        return at.attention_with_paged_kv_cache(
            *self.step, layer, torch.tensor(self.starts), self.cu_step, slots=torch.tensor(self.slots),
            gate=self.gate_step, plan=plan, config=config, split=split,
        )  # fmt: skip
