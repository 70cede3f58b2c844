"""Paged KV cache: fixed-size blocks from one pool, sized from a memory budget.

Every attention layer has a pool tensor ``[num_blocks, block_size, kv_heads, head_dim]``; a
sequence owns a block table (block ids, shared by all layers). Blocks are reference counted:
the ``n`` samples of a request share the prompt's blocks and copy a shared partial block on
their first write (copy-on-write). With prefix caching, every full prompt block is registered
under a digest of all tokens up to its end, and a later prompt with the same leading tokens
reuses those blocks instead of recomputing them; registered blocks nobody holds stay cached
until a new allocation needs them (least recently released first) or the weights change
(:meth:`PagedKVCache.flush`).

The Triton attention (CUDA, correctness profile) reads the pool through the step's block tables
and writes the new keys straight into their blocks (:meth:`PagedStepView.paged_layer`): no copy.
The other kernels take contiguous ``[slots, max_len, ...]`` caches, so for them a step gathers each
packed sequence's blocks into a staging view per layer (:meth:`PagedStepView.layer`), the kernel
writes the new keys there and attends, and the new positions are scattered back to their blocks
before the next layer's view is built. Either way the keys a query sees are the same bits as in a
contiguous cache, so results are unchanged.

Scratch block (:meth:`PagedKVCache.scratch_block`): one block taken out of circulation for padding rows, the
rows a step computes only to reach a row count (a decode graph's bucket, a multiple of TP under sequence
parallelism): each is a one-token sequence at position 0 whose key goes to that block and which attends to it
alone. No sequence is ever given the block, so padding never touches a sequence's keys.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import torch

from megatron_iso.ops.attention.kv_cache import PagedKVLayer

_ELEMENT_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVCache:
    """The attention layers' :class:`~megatron_iso.inference.state.SequenceStateCache`."""

    kind = "attention_kv"

    def __init__(
        self,
        layers: Sequence[int],
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        prefix_caching: bool = True,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"PagedKVCache: num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.block_size, self.num_blocks, self.prefix_caching = block_size, num_blocks, prefix_caching
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.refcount = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out the lowest id first
        self._evictable: OrderedDict[int, bytes] = OrderedDict()  # registered, held by nobody
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self._scratch: int | None = None  # the padding rows' block, out of circulation (scratch_block)
        # [num_blocks, block_size, layers, k]: each cached token's MoE experts (inference.routing_record); None: off.
        self.routes: torch.Tensor | None = None

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * _ELEMENT_BYTES[dtype]

    @classmethod
    def from_budget(
        cls,
        budget_bytes: int,
        layers: Sequence[int],
        block_size: int,
        kv_heads: int,
        head_dim: int,
        **kwargs: object,
    ) -> PagedKVCache:
        """As many blocks as ``budget_bytes`` holds (k and v of every attention layer)."""
        dtype = kwargs.get("dtype", torch.bfloat16)
        per = cls.bytes_per_block(len(layers), block_size, kv_heads, head_dim, dtype)
        if budget_bytes < per:
            raise ValueError(f"kv_cache_bytes={budget_bytes} is below one block ({per} bytes)")
        return cls(layers, budget_bytes // per, block_size, kv_heads, head_dim, **kwargs)

    # --- prefix digests -------------------------------------------------------------------
    def _keys(self, tokens: Sequence[int], full_blocks: int) -> list[bytes]:
        out, h = [], hashlib.sha256()
        bs = self.block_size
        for b in range(full_blocks):
            h.update(b"".join(int(t).to_bytes(8, "little") for t in tokens[b * bs : (b + 1) * bs]))
            out.append(h.copy().digest())  # a digest of every token up to this block's end
        return out

    def match_prefix(self, tokens: Sequence[int]) -> int:
        if not self.prefix_caching:
            return 0
        # At least the last prompt token is recomputed: its logits start generation.
        hits = 0
        for key in self._keys(tokens, (len(tokens) - 1) // self.block_size):
            if key not in self._by_key:
                break
            hits += 1
        return hits * self.block_size

    # --- blocks ---------------------------------------------------------------------------
    def _alloc(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, key = self._evictable.popitem(last=False)
            del self._by_key[key], self._key_of[block]
        else:
            raise RuntimeError("KV cache out of blocks (the engine's reservation should have prevented this)")
        self.refcount[block] = 1
        return block

    def _acquire(self, block: int) -> None:
        if self.refcount[block] == 0:
            self._evictable.pop(block, None)
        self.refcount[block] += 1

    def _drop(self, block: int) -> None:
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            if block in self._key_of:
                self._evictable[block] = self._key_of[block]
            else:
                self._free.append(block)

    def admit(self, seq_id: int, tokens: Sequence[int], num_cached: int) -> None:
        if num_cached % self.block_size:
            raise ValueError(f"num_cached={num_cached} must be a multiple of block_size={self.block_size}")
        blocks = [self._by_key[k] for k in self._keys(tokens, num_cached // self.block_size)]
        for b in blocks:
            self._acquire(b)
        self.tables[seq_id], self.lengths[seq_id] = blocks, num_cached

    def fork(self, parent: int, child: int) -> None:
        for b in self.tables[parent]:
            self._acquire(b)
        self.tables[child], self.lengths[child] = list(self.tables[parent]), self.lengths[parent]

    def prepare_append(self, seq_id: int, start: int, count: int) -> None:
        table, bs = self.tables[seq_id], self.block_size
        if start != self.lengths[seq_id]:
            raise ValueError(f"sequence {seq_id} appends at {start} but holds {self.lengths[seq_id]} tokens")
        first = start // bs
        if first < len(table) and self.refcount[table[first]] > 1:
            # Shared partial block: this sequence's writes go to its own copy.
            new = self._alloc()
            for pool in (*self.k.values(), *self.v.values(), *([] if self.routes is None else [self.routes])):
                pool[new] = pool[table[first]]
            self._drop(table[first])
            table[first] = new
        while len(table) < _ceil_div(start + count, bs):
            table.append(self._alloc())
        self.lengths[seq_id] = start + count

    def commit_prefix(self, seq_id: int, tokens: Sequence[int]) -> None:
        if not self.prefix_caching:
            return
        table = self.tables[seq_id]
        full = min(len(tokens), self.lengths[seq_id]) // self.block_size
        for b, key in enumerate(self._keys(tokens, full)):
            block = table[b]
            if key not in self._by_key and block not in self._key_of:
                self._by_key[key], self._key_of[block] = block, key

    def release(self, seq_id: int) -> None:
        for b in self.tables.pop(seq_id):
            self._drop(b)
        del self.lengths[seq_id]

    def flush(self) -> None:
        if self.tables:
            raise RuntimeError(f"flush with {len(self.tables)} running sequences; finish or abort them first")
        self._free.extend(self._evictable)
        self._free.sort(reverse=True)
        self._evictable.clear()
        self._by_key.clear()
        self._key_of.clear()

    # --- capacity -------------------------------------------------------------------------
    def cost(self, prompt_len: int, total_len: int, n: int, shared: bool, num_cached: int) -> int:
        bs = self.block_size
        if shared:  # one prompt prefill, then each sample copies the partial block and grows
            return _ceil_div(prompt_len, bs) - num_cached // bs + n * (_ceil_div(total_len, bs) - prompt_len // bs)
        return n * (_ceil_div(total_len, bs) - num_cached // bs)

    def remaining(self, seq_id: int, total_len: int) -> int:
        """Blocks this running sequence may still allocate before reaching ``total_len`` tokens."""
        table, length, bs = self.tables[seq_id], self.lengths[seq_id], self.block_size
        cow = int(length % bs != 0 and self.refcount[table[-1]] > 1)
        return max(0, _ceil_div(total_len, bs) - len(table)) + cow

    def free_units(self) -> int:
        return len(self._free) + len(self._evictable)

    def capacity(self) -> int:
        return self.num_blocks - (self._scratch is not None)

    def scratch_block(self) -> int:
        """The block padding rows write their keys into (module docstring): taken out of circulation for good at
        the first call, the same block at every later one (decode graphs and padded eager steps share it)."""
        if self._scratch is None:
            if len(self._free) < 2:
                raise ValueError(
                    f"scratch_block: {len(self._free)} free block(s) of {self.num_blocks}; the cache needs one block "
                    "left for sequences besides the padding rows' block (raise kv_cache_bytes)"
                )
            self._scratch = self._free.pop(0)  # the highest free id: sequences are handed the lowest first
        return self._scratch

    @property
    def cached_blocks(self) -> int:
        """Blocks registered for prefix reuse (held or not)."""
        return len(self._key_of)

    def step_view(
        self, seq_ids: Sequence[int], starts: Sequence[int], counts: Sequence[int], *, padding: int = 0
    ) -> PagedStepView:
        """The step's view of the sequences ``seq_ids`` (slot i = sequence i), then ``padding`` padding rows:
        one token at position 0 each, in the scratch block (:meth:`scratch_block`)."""
        tables = [self.tables[s] for s in seq_ids]
        if padding:
            block = self.scratch_block()
            tables, starts, counts = tables + [[block]] * padding, [*starts, *[0] * padding], [*counts, *[1] * padding]
        return PagedStepView.from_host(self, tables, starts, counts)


class PagedStepView:
    """One step's view of the packed sequences' blocks (slot i = sequence i): a contiguous staging
    per layer (:meth:`layer`) or the pool itself with block tables (:meth:`paged_layer`).

    Built from the host lists of an engine step (the constructor), or, for a captured decode step, on
    device tensors that are rewritten between replays (:meth:`on_device`): then the staging and
    write-back rows are derived on the device inside the step, never baked into it."""

    def __init__(
        self,
        cache: PagedKVCache,
        shape: tuple[int, int],
        write_idx: torch.Tensor,
        *,
        host_block_tables: torch.Tensor | None = None,
        block_tables: torch.Tensor | None = None,
        write_src: torch.Tensor | None = None,
        device_starts: torch.Tensor | None = None,
    ) -> None:
        """Use :meth:`from_host` or :meth:`on_device`. ``shape``: ``(sequences, staged length)``;
        ``write_idx``: the pool row of every new token; block tables on the host and/or the device;
        ``write_src`` (host-built) or ``device_starts`` (derived on the device): where the staged layer's
        new tokens sit."""
        self.cache, self.shape, self.write_idx = cache, shape, write_idx
        self.device = write_idx.device
        self.host_block_tables = host_block_tables  # [n, width] block ids, on the host (host-built views)
        self.block_tables = block_tables  # the same on the device (host-built: at the first paged_layer)
        self._write_src, self._device_starts = write_src, device_starts
        self._staging: tuple[torch.Tensor, torch.Tensor] | None = None  # (read rows, write-back sources)
        self._pending: tuple[int, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_host(
        cls, cache: PagedKVCache, tables: list[list[int]], starts: Sequence[int], counts: Sequence[int]
    ) -> PagedStepView:
        """An engine step from its host lists: each sequence's blocks, cached length and new tokens."""
        bs = cache.block_size
        n = len(tables)
        start_t = torch.tensor(list(starts), dtype=torch.int64)
        count_t = torch.tensor(list(counts), dtype=torch.int64)
        length = int((start_t + count_t).max())
        width = _ceil_div(length, bs)
        padded = torch.tensor([t[:width] + [0] * (width - len(t[:width])) for t in tables], dtype=torch.int64)
        device = next(iter(cache.k.values())).device
        # The positions this step writes, sequence by sequence: integer indices (a boolean mask would
        # need a nonzero(), i.e. a host sync on GPU, in every layer's write-back).
        row = torch.repeat_interleave(torch.arange(n), count_t)
        first = torch.cumsum(count_t, 0) - count_t
        at = start_t[row] + torch.arange(int(count_t.sum())) - first[row]
        # non_blocking: a blocking host-to-device copy is a host sync on GPU
        return cls(
            cache,
            (n, length),
            (padded[row, at // bs] * bs + at % bs).to(device, non_blocking=True),  # in the pool
            host_block_tables=padded,
            write_src=(row * length + at).to(device, non_blocking=True),  # in the staged [n * L] rows
        )

    @classmethod
    def on_device(
        cls,
        cache: PagedKVCache,
        block_tables: torch.Tensor,
        write_idx: torch.Tensor,
        cache_seqlens: torch.Tensor,
        length: int,
    ) -> PagedStepView:
        """A decode step (one new token per row) laid out in device tensors: ``block_tables [n, width]``,
        the pool row each row writes, each row's cached length, and a staging length
        ``<= width * block_size``."""
        if length > block_tables.shape[1] * cache.block_size:
            raise ValueError(f"staging length {length} exceeds the block table ({block_tables.shape[1]} blocks)")
        shape = (int(block_tables.shape[0]), int(length))
        return cls(cache, shape, write_idx, block_tables=block_tables, device_starts=cache_seqlens)

    def _staging_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[n * L] pool row of every staged position, and the staged row of every new token (the
        paged path never needs them)."""
        if self._staging is None:
            bs, (n, length) = self.cache.block_size, self.shape
            if self._device_starts is None:
                pos = torch.arange(length)
                flat = self.host_block_tables[:, pos // bs] * bs + pos % bs
                self._staging = (flat.reshape(-1).to(self.device, non_blocking=True), self._write_src)
            else:
                pos = torch.arange(length, device=self.device)
                flat = self.block_tables[:, pos // bs] * bs + pos % bs
                src = torch.arange(n, device=self.device) * length + self._device_starts
                self._staging = (flat.reshape(-1), src)
        return self._staging

    def _stage(self, pool: torch.Tensor) -> torch.Tensor:
        rows = self._staging_rows()[0]
        return pool.flatten(0, 1).index_select(0, rows).view(*self.shape, *pool.shape[2:])

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._write_back()
        k = self._stage(self.cache.k[index])
        v = self._stage(self.cache.v[index])
        self._pending = (index, k, v)
        return k, v

    def paged_layer(self, index: int) -> PagedKVLayer:
        """Layer ``index``'s pool, the step's block tables (row i = sequence i) and write rows, for a
        kernel that reads blocks in place: no staging, nothing to write back."""
        self._write_back()
        if self.block_tables is None:  # one host-to-device copy per step, shared by the layers
            self.block_tables = self.host_block_tables.to(self.device, non_blocking=True)
        return PagedKVLayer(self.cache.k[index], self.cache.v[index], self.block_tables, self.write_idx)

    def _write_back(self) -> None:
        """Scatter the positions the kernel wrote in the staged layer back into its blocks."""
        if self._pending is None:
            return
        index, k, v = self._pending
        src = self._staging_rows()[1]
        for pool, staged in ((self.cache.k[index], k), (self.cache.v[index], v)):
            pool.flatten(0, 1).index_copy_(0, self.write_idx, staged.flatten(0, 1).index_select(0, src))
        self._pending = None

    def finish(self) -> None:
        """End of the step: write back the last staged layer. A device-laid-out view forgets its derived
        rows, so the next step (or the next replay's capture) derives them from the rewritten tensors."""
        self._write_back()
        if self._device_starts is not None:
            self._staging = None

    def discard(self) -> None:
        """Forget a step that did not finish (an exception mid-forward): its staged layer is not written
        back and its derived rows are not reused by the next step."""
        self._staging = self._pending = None
