"""Per-sequence recurrent state of the Gated DeltaNet layers (the GDN counterpart of ``KVCache``).

For each GDN layer and cache slot:

- ``conv``: the last ``K - 1`` inputs of the causal conv (pre-activation q/k/v channels);
- ``running``: the recurrent-scan state after the sequence's last token (fp32; the scan form's, empty for the chunk form);
- ``entry``: the entry state of the sequence's open chunk, as the chunked state pass computed it (fp32);
  ``entry_bf16``: the same rounded to bf16 (chunk form: what its bf16 decode dots read);
- ``buf_*``: the open chunk's tokens so far (k, g, beta in fp32; v in v's dtype or fp32), so that when the chunk closes the
  state pass can be re-run over the whole chunk, exactly as the training forward runs it; ``buf_u``: their u rows
  (the GPU kernels' chunk form, whose decode step reads the earlier rows instead of recomputing them); ``buf_y``: their
  rows of the block forward substitution's right-hand side Y (chunk form: a decode step's u row reads its block's);
  ``buf_tinv``: the rows of ``T^{-1}``'s diagonal blocks computed so far, per value head (chunk form: a decode step
  computes its token's row from them instead of inverting the chunk's block again).

How many tokens a slot holds is not stored here: the batch's ``cache_seqlens`` (one per sequence,
shared with the KV cache) gives each sequence's position, and position ``p`` means ``p % chunk``
tokens are buffered. Position 0 means "fresh": kernels then ignore (and overwrite) whatever a slot
holds, so a slot needs no reset between sequences.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

# How a GPU call computes a chunk's outputs (profile.gdn_form; the Triton module's FORMS): "scan", the per-token
# recurrence the CPU reference computes, or "chunk", output tiles (GPU only, docs/GDN.md "Output forms"). The state
# cache holds what its form's decode reads.
OUTPUT_FORMS = ("scan", "chunk")
VALUE_BUFFER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # buf_v: each widens exactly to fp32
U_BUFFER_DTYPES = (torch.float32, torch.bfloat16)  # buf_u: fp32, or bf16 where the chunk form stores u as bf16


def check_value_buffer(state: GDNLayerState, v_dtype: torch.dtype, where: str) -> None:
    """Refuse a ``buf_v`` that cannot hold this call's v exactly (narrower than v: a bf16 buffer for fp32 v): the
    tokens a call leaves in an open chunk are re-read when the chunk closes, and must be the values it was given."""
    if state.buf_v.dtype not in (torch.float32, v_dtype):
        raise ValueError(
            f"{where}: state.buf_v is {state.buf_v.dtype}, which cannot hold this call's {v_dtype} v exactly; allocate "
            f"the GDN state with v_dtype={v_dtype} (v's own dtype) or torch.float32"
        )


@dataclass
class GDNLayerState:
    conv: torch.Tensor  # [slots, conv_dim, K - 1] (model dtype)
    running: torch.Tensor  # [slots, Hv, Dk, Dv] fp32 (form "scan"; [slots, 0, 0, 0] for "chunk")
    entry: torch.Tensor  # [slots, Hv, Dk, Dv] fp32
    # [slots, Hv, Dk, Dv] bf16: ``entry`` rounded to bf16, the operand a bf16 decode dot rounds it to anyway, so a
    # decode step reads half the bytes for the same bits (form "chunk"; [slots, 0, 0, 0] for "scan")
    entry_bf16: torch.Tensor
    buf_k: torch.Tensor  # [slots, C, Hk, Dk] fp32
    # [slots, C, Hv, Dv] in ``v_dtype``: v's own dtype (the model's; bf16 halves the bytes a decode step reads) or fp32;
    # either holds v exactly (check_value_buffer)
    buf_v: torch.Tensor
    buf_g: torch.Tensor  # [slots, C, Hv] fp32 (log decay)
    buf_beta: torch.Tensor  # [slots, C, Hv] fp32
    # [slots, C, Hv, Dv] in ``u_dtype``: the open chunk's u rows (form "chunk"; [slots, 0, 0, 0] for "scan"), fp32 or the
    # dtype the chunk form stores u in (bf16 with bf16 chain dots: triton.tuning.chunk_u_dtype)
    buf_u: torch.Tensor
    buf_y: torch.Tensor  # [slots, C, Hv, Dv] in ``u_dtype``: the open chunk's Y rows (form "chunk"; as buf_u)
    buf_tinv: torch.Tensor  # [slots, Hv, C, C] fp32: the open chunk's T^{-1} rows (form "chunk"; [slots, 0, 0, 0])

    @property
    def chunk(self) -> int:
        return self.buf_k.shape[1]

    @classmethod
    def allocate(
        cls,
        slots: int,
        *,
        conv_dim: int,
        conv_kernel: int,
        key_heads: int,
        value_heads: int,
        key_dim: int,
        value_dim: int,
        chunk: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        form: str = "scan",
        v_dtype: torch.dtype = torch.float32,
        u_dtype: torch.dtype = torch.float32,
    ) -> GDNLayerState:
        """``form`` (profile.gdn_form): which of ``running`` (scan) and ``entry_bf16`` / ``buf_u`` / ``buf_y`` /
        ``buf_tinv`` (chunk) the kernels read; the others are allocated empty, so the cache holds no state its form never
        touches. ``dtype``: the conv state's (the model's). ``v_dtype``: ``buf_v``'s, the dtype of the v the layer passes
        (or fp32, which holds any); ``u_dtype``: ``buf_u``'s and ``buf_y``'s (fp32, or bf16 where the chunk form stores
        u and Y so)."""
        if form not in OUTPUT_FORMS:
            raise ValueError(f"GDN state cache: form={form!r} is not allowed; allowed values: {list(OUTPUT_FORMS)}")
        for name, got, allowed in (("v_dtype", v_dtype, VALUE_BUFFER_DTYPES), ("u_dtype", u_dtype, U_BUFFER_DTYPES)):
            if got not in allowed:
                raise ValueError(f"GDN state cache: {name}={got} is not allowed; allowed values: {list(allowed)}")
        f32 = {"dtype": torch.float32, "device": device}
        scan = form == "scan"
        return cls(
            conv=torch.zeros(slots, conv_dim, conv_kernel - 1, dtype=dtype, device=device),
            running=torch.zeros(slots, *((value_heads, key_dim, value_dim) if scan else (0, 0, 0)), **f32),
            entry=torch.zeros(slots, value_heads, key_dim, value_dim, **f32),
            entry_bf16=torch.zeros(
                slots, *((0, 0, 0) if scan else (value_heads, key_dim, value_dim)), dtype=torch.bfloat16, device=device
            ),
            buf_k=torch.zeros(slots, chunk, key_heads, key_dim, **f32),
            buf_v=torch.zeros(slots, chunk, value_heads, value_dim, dtype=v_dtype, device=device),
            buf_g=torch.zeros(slots, chunk, value_heads, **f32),
            buf_beta=torch.zeros(slots, chunk, value_heads, **f32),
            buf_u=torch.zeros(
                slots, *((0, 0, 0) if scan else (chunk, value_heads, value_dim)), dtype=u_dtype, device=device
            ),
            buf_y=torch.zeros(
                slots, *((0, 0, 0) if scan else (chunk, value_heads, value_dim)), dtype=u_dtype, device=device
            ),
            buf_tinv=torch.zeros(slots, *((0, 0, 0) if scan else (value_heads, chunk, chunk)), **f32),
        )


@dataclass
class GDNStateCache:
    """GDN state of every GDN layer (keyed by the 0-based decoder layer index)."""

    layers: dict[int, GDNLayerState]

    @classmethod
    def allocate(cls, layer_indices: Iterable[int], slots: int, **shape: object) -> GDNStateCache:
        """One :class:`GDNLayerState` per layer index; ``shape`` as :meth:`GDNLayerState.allocate`
        (head counts are this TP rank's)."""
        return cls(layers={int(i): GDNLayerState.allocate(slots, **shape) for i in layer_indices})

    def layer(self, i: int) -> GDNLayerState:
        try:
            return self.layers[i]
        except KeyError:
            raise KeyError(f"GDN state cache has no layer {i}; it holds layers {sorted(self.layers)}") from None
