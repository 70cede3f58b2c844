"""Full (HF-named) weights <-> this rank's Megatron parameters, for any TP layout.

The canonical form of a model's weights is the HF transformers state dict (Qwen3 names): it is
what checkpoints ship as, and what TP-invariance tests load into every layout. Sharding rules:

- ``linear_qkv``: per query group g, rows ``[q heads of g | (gate heads of g) | k_g | v_g]``
  (Megatron's grouped layout), groups split contiguously over TP ranks;
- ``linear_fc1``: this rank's gate rows, then its up rows;
- column-parallel (qkv, fc1, output layer, embedding): rows split; row-parallel (proj, fc2):
  columns split; norms replicated;
- MoE (Qwen3-MoE / Qwen3-Next names): ``mlp.gate`` -> ``mlp.router`` (replicated); expert e lives
  whole (expert TP = 1) on EP rank ``e // (E / ep)`` as ``mlp.experts.local_experts.{e mod E/ep}``;
  the shared expert is TP-sharded like a dense MLP, its ``shared_expert_gate`` replicated;
- Gated DeltaNet (``linear_attn.*``): Qwen3-Next groups ``in_proj_qkvz`` / ``in_proj_ba`` rows per key
  head, Qwen3.5 stores flat ``in_proj_qkv`` ([all q | all k | all v]), ``in_proj_z``, ``in_proj_b``,
  ``in_proj_a`` (``cfg.hf_gdn_layout``: :func:`_gdn_pieces` is the one place that reads either); Megatron's ``in_proj`` holds per rank ``[q | k | v | z | b | a]`` of the rank's key heads and
  their value heads; ``conv1d`` channels ``[q | k | v]`` of the rank; ``A_log``/``dt_bias`` split;
  ``norm`` -> ``out_norm`` replicated; ``out_proj`` columns split.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from megatron_iso.models.gdn import gdn_layer_indices
from megatron_iso.models.stages import current_stage, from_global_names
from megatron_iso.models.transformer_config import IsoTransformerConfig, sharded_sizes
from megatron_iso.models.weight_source import WeightSource, as_source
from megatron_iso.settings import resolve_parallel


def _qkv_rows(cfg: IsoTransformerConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q/k/v projections of some query groups (all, or one TP rank's) -> Megatron's grouped qkv rows."""
    d = cfg.kv_channels
    per = cfg.num_attention_heads // cfg.num_query_groups
    ng = k.shape[0] // d  # the groups given
    hidden = q.shape[1]
    if cfg.attention_output_gate:
        # HF Qwen3-Next q_proj: per head [query (d) | gate (d)].
        qg = q.view(ng * per, 2, d, hidden)
        qh, gh = qg[:, 0].reshape(ng, per * d, hidden), qg[:, 1].reshape(ng, per * d, hidden)
        parts = [qh, gh]
    else:
        parts = [q.view(ng, per * d, hidden)]
    parts += [k.view(ng, d, hidden), v.view(ng, d, hidden)]
    return torch.cat(parts, dim=1).reshape(-1, hidden)


def _check_layout(cfg: IsoTransformerConfig, tp: int, ep: int = 1) -> None:
    """The settings' one check of a layout (``settings.resolve_parallel``: positive degrees that divide every size
    Megatron shards, EP 1 for a dense model), at the ``tp`` / ``ep`` given here: tools and tests shard one config's
    weights at layouts other than its own."""
    resolve_parallel({"tp": tp, "ep": ep}, sharded_sizes(cfg))


# Megatron names of parameters that live on one EP rank (experts are never TP-split); all others are
# the same on every EP rank.
EXPERT_PARAM = ".mlp.experts.local_experts."


def is_expert_param(name: str) -> bool:
    """Whether a Megatron parameter name belongs to an EP rank's experts (see :data:`EXPERT_PARAM`)."""
    return EXPERT_PARAM in name


def _swiglu_mlp(hf: WeightSource, src: str, dst: str, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """HF gate/up/down projections under ``src`` -> Megatron linear_fc1 (gate rows, then up rows)/fc2."""
    if tp == 1:  # whole tensors (a routed expert): no slicing
        gate, up, down = (hf.full(src + n) for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
    else:
        gate, up = hf.rows(src + "gate_proj.weight", rank, tp), hf.rows(src + "up_proj.weight", rank, tp)
        down = hf.cols(src + "down_proj.weight", rank, tp)
    return {dst + "linear_fc1.weight": torch.cat([gate, up]), dst + "linear_fc2.weight": down}


def _moe_mlp(
    hf: WeightSource,
    cfg: IsoTransformerConfig,
    src: str,
    dst: str,
    rank: int,
    tp: int,
    ep_rank: int,
    ep: int,
) -> dict[str, torch.Tensor]:
    local = cfg.num_moe_experts // ep
    out = {dst + "router.weight": hf.full(src + "gate.weight")}
    for i in range(local):
        out |= _swiglu_mlp(hf, f"{src}experts.{ep_rank * local + i}.", f"{dst}experts.local_experts.{i}.", 0, 1)
    if cfg.moe_shared_expert_intermediate_size is not None:
        out |= _swiglu_mlp(hf, src + "shared_expert.", dst + "shared_experts.", rank, tp)
        if cfg.moe_shared_expert_gate:
            out[dst + "shared_experts.gate_weight"] = hf.full(src + "shared_expert_gate.weight")
    return out


def _gdn_dims(cfg: IsoTransformerConfig) -> tuple[int, int, int, int, int]:
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    return hk, hv, cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk


# GDN's HF input projections as per-key-head pieces [hk, rows, hidden] of q, k, v, z, b, a (value heads
# kh*r .. kh*r+r-1 belong to key head kh in both layouts). The two HF layouts differ only in how these
# pieces are laid out; everything else (sharding, Megatron's in_proj order) works on the pieces.
_GDN_PIECES = ("q", "k", "v", "z", "b", "a")


def _gdn_piece_rows(cfg: IsoTransformerConfig) -> list[int]:
    _, _, dk, dv, r = _gdn_dims(cfg)
    return [dk, dk, r * dv, r * dv, r, r]


def _gdn_hf_tensors(cfg: IsoTransformerConfig) -> dict[str, list[str]]:
    """HF tensor name (under ``linear_attn.``) -> the pieces it holds, for ``cfg.hf_gdn_layout``."""
    if cfg.hf_gdn_layout == "split":  # Qwen3.5: flat, each piece's heads one after another
        return {
            "in_proj_qkv.weight": ["q", "k", "v"],
            "in_proj_z.weight": ["z"],
            "in_proj_b.weight": ["b"],
            "in_proj_a.weight": ["a"],
        }
    return {"in_proj_qkvz.weight": ["q", "k", "v", "z"], "in_proj_ba.weight": ["b", "a"]}  # Qwen3-Next: per key head


def _gdn_rank_pieces(
    hf: WeightSource, cfg: IsoTransformerConfig, src: str, rank: int, tp: int
) -> dict[str, torch.Tensor]:
    """This TP rank's key heads of the HF GDN projections under ``src``: {piece: [hk / tp, rows, hidden]}. Both
    layouts keep a piece's key heads in order, so a rank's heads are one block of rows (per piece, when flat)."""
    hk = cfg.linear_num_key_heads
    rows = dict(zip(_GDN_PIECES, _gdn_piece_rows(cfg), strict=True))
    out = {}
    for name, pieces in _gdn_hf_tensors(cfg).items():
        if cfg.hf_gdn_layout == "split":
            offset = 0
            for p in pieces:
                block = hf.rows(src + name, rank, tp, start=offset, length=hk * rows[p])
                out[p] = block.view(hk // tp, rows[p], -1)
                offset += hk * rows[p]
        else:
            w = hf.rows(src + name, rank, tp)
            parts = w.view(hk // tp, -1, w.shape[1]).split([rows[p] for p in pieces], dim=1)
            out |= dict(zip(pieces, parts, strict=True))
    return out


def _gdn_from_pieces(
    pieces: Mapping[str, torch.Tensor], cfg: IsoTransformerConfig, dst: str
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`_gdn_pieces` ({piece: [hk, rows, hidden]} of all key heads -> HF tensors)."""
    out = {}
    for name, names in _gdn_hf_tensors(cfg).items():
        hidden = pieces[names[0]].shape[-1]
        if cfg.hf_gdn_layout == "split":
            out[dst + name] = torch.cat([pieces[p].reshape(-1, hidden) for p in names])
        else:
            out[dst + name] = torch.cat([pieces[p] for p in names], dim=1).reshape(-1, hidden)
    return out


def _gdn_shard(hf: WeightSource, cfg: IsoTransformerConfig, src: str, dst: str, rank: int, tp: int):
    hk, hv, dk, dv, _ = _gdn_dims(cfg)
    pieces = _gdn_rank_pieces(hf, cfg, src, rank, tp)
    hidden = pieces["q"].shape[-1]
    conv, offset = [], 0
    for length in (hk * dk, hk * dk, hv * dv):  # the [q | k | v] channels, each split over the ranks
        conv.append(hf.rows(src + "conv1d.weight", rank, tp, start=offset, length=length))
        offset += length
    return {
        dst + "in_proj.weight": torch.cat([pieces[p].reshape(-1, hidden) for p in _GDN_PIECES]),
        dst + "conv1d.weight": torch.cat(conv),
        dst + "A_log": hf.rows(src + "A_log", rank, tp),
        dst + "dt_bias": hf.rows(src + "dt_bias", rank, tp),
        dst + "out_norm.weight": hf.full(src + "norm.weight"),
        dst + "out_proj.weight": hf.cols(src + "out_proj.weight", rank, tp),
    }


def _gdn_unshard(shards: Sequence[Mapping[str, torch.Tensor]], cfg: IsoTransformerConfig, src: str, dst: str):
    hk, _, dk, dv, r = _gdn_dims(cfg)
    hk_l = hk // len(shards)
    rows = _gdn_piece_rows(cfg)
    per_rank, conv = [], []
    for s in shards:
        w = s[src + "in_proj.weight"]
        parts = w.split([hk_l * n for n in rows])
        per_rank.append([t.reshape(hk_l, n, w.shape[1]) for t, n in zip(parts, rows, strict=True)])
        conv.append(s[src + "conv1d.weight"].split([hk_l * dk, hk_l * dk, hk_l * r * dv]))
    pieces = {p: torch.cat([ranks[j] for ranks in per_rank]) for j, p in enumerate(_GDN_PIECES)}
    return {
        **_gdn_from_pieces(pieces, cfg, dst),
        dst + "conv1d.weight": torch.cat([torch.cat([c[j] for c in conv]) for j in range(3)]),
        dst + "A_log": torch.cat([s[src + "A_log"] for s in shards]),
        dst + "dt_bias": torch.cat([s[src + "dt_bias"] for s in shards]),
        dst + "norm.weight": _replicated(shards, src + "out_norm.weight"),
        dst + "out_proj.weight": torch.cat([s[src + "out_proj.weight"] for s in shards], dim=1),
    }


def _gdn_shapes(cfg: IsoTransformerConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    hk, hv, dk, dv, _ = _gdn_dims(cfg)
    h = cfg.hidden_size
    rows = dict(zip(_GDN_PIECES, _gdn_piece_rows(cfg), strict=True))
    shapes = {prefix + name: (hk * sum(rows[p] for p in pieces), h) for name, pieces in _gdn_hf_tensors(cfg).items()}
    return shapes | {
        prefix + "conv1d.weight": (2 * hk * dk + hv * dv, 1, cfg.linear_conv_kernel_dim),
        prefix + "A_log": (hv,),
        prefix + "dt_bias": (hv,),
        prefix + "norm.weight": (dv,),
        prefix + "out_proj.weight": (h, hv * dv),
    }


def megatron_shard(
    hf: Mapping[str, torch.Tensor] | WeightSource,
    cfg: IsoTransformerConfig,
    rank: int,
    tp: int,
    ep_rank: int = 0,
    ep: int = 1,
) -> dict[str, torch.Tensor]:
    """This (TP, EP) rank's Megatron parameters (GPTModel names) from HF-named weights: a full state dict, or a
    :class:`~megatron_iso.models.weight_source.WeightSource` asked only for this rank's rows, columns and experts."""
    _check_layout(cfg, tp, ep)
    if not (0 <= rank < tp and 0 <= ep_rank < ep):
        raise ValueError(f"rank {rank} / ep_rank {ep_rank} outside the layout tp={tp}, ep={ep}")
    hf = as_source(hf)
    out: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": hf.rows("model.embed_tokens.weight", rank, tp)}
    gdn = set(gdn_layer_indices(cfg))
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = src + "self_attn."
        if i in gdn:
            out |= _gdn_shard(hf, cfg, src + "linear_attn.", dst + "self_attention.", rank, tp)
        else:
            q, k, v = (hf.rows(attn + f"{n}_proj.weight", rank, tp) for n in "qkv")
            out[dst + "self_attention.linear_qkv.weight"] = _qkv_rows(cfg, q, k, v)
            out[dst + "self_attention.linear_proj.weight"] = hf.cols(attn + "o_proj.weight", rank, tp)
        if cfg.qk_layernorm and i not in gdn:
            out[dst + "self_attention.q_layernorm.weight"] = hf.full(attn + "q_norm.weight")
            out[dst + "self_attention.k_layernorm.weight"] = hf.full(attn + "k_norm.weight")
        out[dst + "input_layernorm.weight"] = hf.full(src + "input_layernorm.weight")
        out[dst + "pre_mlp_layernorm.weight"] = hf.full(src + "post_attention_layernorm.weight")
        if cfg.num_moe_experts:
            out |= _moe_mlp(hf, cfg, src + "mlp.", dst + "mlp.", rank, tp, ep_rank, ep)
        else:
            out |= _swiglu_mlp(hf, src + "mlp.", dst + "mlp.", rank, tp)
    out["decoder.final_layernorm.weight"] = hf.full("model.norm.weight")
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = hf.rows("lm_head.weight", rank, tp)
    return out


def _split_qkv(cfg: IsoTransformerConfig, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_qkv_rows`: Megatron's full grouped qkv weight -> HF q, k, v projections."""
    d, ng, nq = cfg.kv_channels, cfg.num_query_groups, cfg.num_attention_heads
    per = nq // ng
    hidden = qkv.shape[1]
    q_parts = 2 if cfg.attention_output_gate else 1
    groups = qkv.view(ng, (q_parts * per + 2) * d, hidden)
    q_rows = q_parts * per * d
    q = groups[:, :q_rows]
    if cfg.attention_output_gate:
        # Back to HF's per-head [query | gate] interleave.
        q = q.reshape(ng, 2, per, d, hidden).permute(0, 2, 1, 3, 4)
    k, v = groups[:, q_rows : q_rows + d], groups[:, q_rows + d :]
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def _replicated(shards: Sequence[Mapping[str, torch.Tensor]], name: str) -> torch.Tensor:
    """A tensor every rank holds a copy of; copies that differ mean a corrupt or mixed checkpoint."""
    first = shards[0][name]
    for rank, shard in enumerate(shards[1:], start=1):
        if shard[name].shape != first.shape or not torch.equal(shard[name], first):
            raise ValueError(f"replicated parameter '{name}' differs between TP rank 0 and TP rank {rank}")
    return first


def _swiglu_unshard(shards: Sequence[Mapping[str, torch.Tensor]], src: str, dst: str) -> dict[str, torch.Tensor]:
    """Inverse of :func:`_swiglu_mlp` over the TP ranks' shards (each fc1 is [its gate rows | its up rows])."""
    halves = [s[src + "linear_fc1.weight"].chunk(2, dim=0) for s in shards]
    return {
        dst + "gate_proj.weight": torch.cat([g for g, _ in halves]),
        dst + "up_proj.weight": torch.cat([u for _, u in halves]),
        dst + "down_proj.weight": torch.cat([s[src + "linear_fc2.weight"] for s in shards], dim=1),
    }


def _moe_unshard(
    tp_shards: Sequence[Mapping[str, torch.Tensor]],
    ep_shards: Sequence[Mapping[str, torch.Tensor]],
    cfg: IsoTransformerConfig,
    src: str,
    dst: str,
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`_moe_mlp`: router and shared expert from the TP ranks, experts from the EP ranks."""
    local = cfg.num_moe_experts // len(ep_shards)
    out = {dst + "gate.weight": _replicated(tp_shards, src + "router.weight")}
    for ep_rank, shard in enumerate(ep_shards):
        for i in range(local):
            out |= _swiglu_unshard([shard], f"{src}experts.local_experts.{i}.", f"{dst}experts.{ep_rank * local + i}.")
    if cfg.moe_shared_expert_intermediate_size is not None:
        out |= _swiglu_unshard(tp_shards, src + "shared_experts.", dst + "shared_expert.")
        if cfg.moe_shared_expert_gate:
            out[dst + "shared_expert_gate.weight"] = _replicated(tp_shards, src + "shared_experts.gate_weight")
    return out


def hf_from_megatron_shards(
    shards: Sequence[Mapping[str, torch.Tensor]], cfg: IsoTransformerConfig, ep: int = 1
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`megatron_shard`: every rank's parameters -> full HF-named state dict.

    ``shards[ep_rank * tp + tp_rank]`` is rank (tp_rank, ep_rank)'s dict (EP-major; ``tp = len(shards)
    // ep``). Non-expert tensors come from EP rank 0's TP ranks, each EP rank's experts from its TP
    rank 0 (expert TP is 1, so the other TP ranks hold the same experts). Only concatenation and
    reshapes, so ``hf_from_megatron_shards([megatron_shard(hf, cfg, t, tp, e, ep) for e in range(ep)
    for t in range(tp)], cfg, ep)`` reproduces ``hf`` bit for bit."""
    if ep < 1 or len(shards) % ep:
        raise ValueError(f"{len(shards)} rank shards do not form a layout with ep={ep}")
    tp = len(shards) // ep
    _check_layout(cfg, tp, ep)
    tp_shards, ep_shards = shards[:tp], shards[::tp]

    def rows(name: str) -> torch.Tensor:
        return torch.cat([s[name] for s in tp_shards], dim=0)

    def cols(name: str) -> torch.Tensor:
        return torch.cat([s[name] for s in tp_shards], dim=1)

    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rows("embedding.word_embeddings.weight")}
    gdn = set(gdn_layer_indices(cfg))
    for i in range(cfg.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = dst + "self_attn."
        if i in gdn:
            out |= _gdn_unshard(tp_shards, cfg, src + "self_attention.", dst + "linear_attn.")
        else:
            q, k, v = _split_qkv(cfg, rows(src + "self_attention.linear_qkv.weight"))
            out |= {attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v}
            out[attn + "o_proj.weight"] = cols(src + "self_attention.linear_proj.weight")
        if cfg.qk_layernorm and i not in gdn:
            out[attn + "q_norm.weight"] = _replicated(tp_shards, src + "self_attention.q_layernorm.weight")
            out[attn + "k_norm.weight"] = _replicated(tp_shards, src + "self_attention.k_layernorm.weight")
        out[dst + "input_layernorm.weight"] = _replicated(tp_shards, src + "input_layernorm.weight")
        out[dst + "post_attention_layernorm.weight"] = _replicated(tp_shards, src + "pre_mlp_layernorm.weight")
        if cfg.num_moe_experts:
            out |= _moe_unshard(tp_shards, ep_shards, cfg, src + "mlp.", dst + "mlp.")
        else:
            out |= _swiglu_unshard(tp_shards, src + "mlp.", dst + "mlp.")
    out["model.norm.weight"] = _replicated(tp_shards, "decoder.final_layernorm.weight")
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = rows("output_layer.weight")
    return {name: t.contiguous() for name, t in out.items()}


def _swiglu_shapes(prefix: str, h: int, f: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (f, h), prefix + "up_proj.weight": (f, h), prefix + "down_proj.weight": (h, f)}


def _moe_shapes(cfg: IsoTransformerConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    h, e = cfg.hidden_size, cfg.num_moe_experts
    shapes = {prefix + "gate.weight": (e, h)}
    for i in range(e):
        shapes |= _swiglu_shapes(f"{prefix}experts.{i}.", h, cfg.moe_ffn_hidden_size)
    if cfg.moe_shared_expert_intermediate_size is not None:
        shapes |= _swiglu_shapes(prefix + "shared_expert.", h, cfg.moe_shared_expert_intermediate_size)
        if cfg.moe_shared_expert_gate:
            shapes[prefix + "shared_expert_gate.weight"] = (1, h)
    return shapes


def hf_shapes(cfg: IsoTransformerConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the HF checkpoint this config describes."""
    h, d, f, v = cfg.hidden_size, cfg.kv_channels, cfg.ffn_hidden_size, cfg.vocab_size
    nq, nkv = cfg.num_attention_heads, cfg.num_query_groups
    q_rows = nq * d * (2 if cfg.attention_output_gate else 1)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    gdn = set(gdn_layer_indices(cfg))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        if i in gdn:
            shapes |= _gdn_shapes(cfg, p + "linear_attn.")
        else:
            shapes |= {
                p + "self_attn.q_proj.weight": (q_rows, h),
                p + "self_attn.k_proj.weight": (nkv * d, h),
                p + "self_attn.v_proj.weight": (nkv * d, h),
                p + "self_attn.o_proj.weight": (h, nq * d),
            }
        shapes |= _moe_shapes(cfg, p + "mlp.") if cfg.num_moe_experts else _swiglu_shapes(p + "mlp.", h, f)
        if cfg.qk_layernorm and i not in gdn:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def random_hf_state_dict(cfg: IsoTransformerConfig, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Seeded random weights in HF naming; norms near 1 (or near 0 when zero-centred)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in hf_shapes(cfg).items():
        if name.endswith("linear_attn.conv1d.weight"):  # depthwise taps: O(1/sqrt(K)) like nn.Conv1d's init
            t = 0.5 * torch.randn(shape, generator=g)
        elif len(shape) == 1:
            # The GDN output norm scales by w (not 1 + w); A_log/dt_bias near 0 give moderate decays.
            plain = name.endswith("linear_attn.norm.weight")
            base = 0.0 if cfg.layernorm_zero_centered_gamma and not plain else 1.0
            if name.endswith(("linear_attn.A_log", "linear_attn.dt_bias")):
                base = 0.0
            t = base + 0.1 * torch.randn(shape, generator=g)
        else:
            t = std * torch.randn(shape, generator=g)
        out[name] = t.to(cfg.params_dtype)
    return out


def check_hf_state_dict(hf: Mapping[str, torch.Tensor] | WeightSource, cfg: IsoTransformerConfig) -> None:
    """Every expected tensor present with the expected shape (a source's shapes: nothing is read); errors name
    the tensor."""
    hf = as_source(hf)
    for name, shape in hf_shapes(cfg).items():
        if name not in hf:
            raise KeyError(f"checkpoint is missing tensor '{name}' (expected shape {list(shape)})")
        if hf.shape(name) != shape:
            raise ValueError(f"tensor '{name}' has shape {list(hf.shape(name))}, expected {list(shape)}")


def load_hf_state_dict(
    model: torch.nn.Module, hf: Mapping[str, torch.Tensor] | WeightSource, cfg: IsoTransformerConfig
) -> None:
    """Copy HF-named weights (full, or a source read for this rank's shard only) into this rank's model (its
    TP / EP rank from Megatron's parallel_state)."""
    from megatron.core import parallel_state

    check_hf_state_dict(hf, cfg)
    rank, tp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    ep_rank, ep = parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size()
    shard = megatron_shard(hf, cfg, rank, tp, ep_rank, ep)
    if cfg.pipeline_model_parallel_size > 1:  # a pipeline stage: its tensors of the whole model, under stage names
        shard = from_global_names(shard, current_stage(cfg))
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(shard))
    if missing:
        raise KeyError(f"no source tensor for model parameters {missing}")
    with torch.no_grad():
        for name, tensor in shard.items():
            if name not in params:
                raise KeyError(f"model has no parameter '{name}'")
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"parameter '{name}': shard shape {list(tensor.shape)} != model {list(params[name].shape)}"
                )
            params[name].copy_(tensor)


# transformers 5 may store a layer's routed experts fused (real Qwen3.5-MoE checkpoints do): 3-D
# ``mlp.experts.gate_up_proj`` [E, 2F, H] (each expert's [gate | up] rows) and ``mlp.experts.down_proj``
# [E, H, F]. The canonical form (hf_shapes) names each expert; these two functions convert, by views only.
FUSED_GATE_UP, FUSED_DOWN = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"


def split_fused_experts(hf: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
    """Per-expert tensors for every fused ``mlp.experts.gate_up_proj`` / ``down_proj`` pair; also whether
    any were fused. A fused tensor without its partner, or of the wrong rank, is an error naming it."""
    out, fused = {}, False
    for name, t in hf.items():
        if name.endswith(FUSED_DOWN) and name[: -len(FUSED_DOWN)] + FUSED_GATE_UP in hf:
            continue  # handled with its gate_up partner
        if not name.endswith(FUSED_GATE_UP):
            out[name] = t
            continue
        layer = name[: -len(FUSED_GATE_UP)]
        down = hf.get(layer + FUSED_DOWN)
        if down is None or t.ndim != 3 or down.ndim != 3 or t.shape[0] != down.shape[0] or t.shape[1] % 2:
            raise ValueError(
                f"fused expert tensor '{name}' {list(t.shape)} needs '{layer + FUSED_DOWN}' "
                f"(shapes [E, 2F, H] and [E, H, F]); got {None if down is None else list(down.shape)}"
            )
        fused = True
        for e in range(t.shape[0]):
            gate, up = t[e].chunk(2)
            p = f"{layer}.mlp.experts.{e}."
            out |= {p + "gate_proj.weight": gate, p + "up_proj.weight": up, p + "down_proj.weight": down[e]}
    return out, fused


def fuse_experts(hf: Mapping[str, torch.Tensor], cfg: IsoTransformerConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`split_fused_experts` for every MoE layer of ``cfg``."""
    out = dict(hf)
    for i in range(cfg.num_layers):
        layer = f"model.layers.{i}"
        names = [f"{layer}.mlp.experts.{e}." for e in range(cfg.num_moe_experts)]
        gate_up = [torch.cat([out.pop(p + "gate_proj.weight"), out.pop(p + "up_proj.weight")]) for p in names]
        out[layer + FUSED_GATE_UP] = torch.stack(gate_up)
        out[layer + FUSED_DOWN] = torch.stack([out.pop(p + "down_proj.weight") for p in names])
    return out
