"""The model group's shape rules, checked before anything is built: every size Megatron and the iso layers assert
on (or fail on with a shape error deep in a forward), named by field with the values it may take.

Megatron's ``TransformerConfig`` asserts the GQA and GDN head ratios and the MoE top-k; the iso layers reshape by
heads, query groups and head dimensions (a ratio that does not divide is a ``view`` error in the first forward);
rotary embeddings rotate pairs of channels. The parallel degrees' divisibility (``parallel.tp`` / ``ep``) is
``settings.parallel.check_shardable``'s; the leaves' (``profile.leaves``) ``settings.profile.validate_profile``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_iso.settings.fields import SettingsError, _get, _number, _required


def _size(model: Mapping[str, Any], key: str, low: int = 1, *, required: bool = True) -> int | None:
    """``model.<key>`` as an integer >= ``low``; None when it is optional and null."""
    value = _required(model, key, "model") if required else _get(model, key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SettingsError(f"model.{key}={value!r} is not allowed; allowed values: integers >= {low}")
    return value


# The model's sizes: positive integers wherever an option sets them.
SIZE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
             "vocab_size", "max_position_embeddings", "linear_conv_kernel_dim", "linear_key_head_dim",
             "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "num_experts", "moe_topk",
             "moe_ffn_hidden_size", "shared_expert_ffn_hidden_size")  # fmt: skip


def check_size_types(model: Mapping[str, Any]) -> None:
    """Every size the model sets is an integer (a bool is not: ``True % 8`` would pass a divisibility check), so
    the checks that divide by them (the profile's leaves, the parallel degrees) see numbers."""
    for key in SIZE_KEYS:
        value = model.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise SettingsError(f"model.{key}={value!r} is not allowed; allowed values: integers >= 1")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_attention(model: Mapping[str, Any]) -> None:
    """Heads, query groups and head size: each query group serves a whole number of heads (Megatron's GQA and the
    attention's reshape), and the rotary part of a head rotates pairs of channels (an even count >= 2)."""
    heads, groups = _size(model, "num_attention_heads"), _size(model, "num_query_groups")
    kv = _size(model, "kv_channels")
    if heads % groups:
        raise SettingsError(
            f"model.num_attention_heads={heads} is not a multiple of model.num_query_groups={groups}: each query "
            f"group (KV head) serves a whole number of attention heads; allowed values: multiples of {groups} "
            f"(or model.num_query_groups in {_divisors(heads)})"
        )
    fraction = _number(_get(model, "rotary_fraction", 1.0), "model.rotary_fraction", 0.0, open_low=True)
    if fraction > 1:
        raise SettingsError(f"model.rotary_fraction={fraction!r} is not allowed; allowed values: numbers in (0, 1]")
    rotary = int(kv * fraction)
    if rotary < 2 or rotary % 2:
        raise SettingsError(
            f"model.kv_channels={kv} x model.rotary_fraction={fraction:g} gives {rotary} rotary channels per head; "
            "RoPE rotates channel pairs: allowed values: kv_channels x rotary_fraction an even integer >= 2"
        )
    _number(_required(model, "rope_theta", "model"), "model.rope_theta", 0.0, open_low=True)


def check_gdn_shapes(model: Mapping[str, Any]) -> None:
    """A hybrid model's Gated DeltaNet sizes: positive, and value heads a multiple of key heads (Megatron's assert;
    each key head's state serves a whole number of value heads)."""
    for key in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim"):
        _size(model, key)
    hk, hv = _size(model, "linear_num_key_heads"), _size(model, "linear_num_value_heads")
    if hv % hk:
        raise SettingsError(
            f"model.linear_num_value_heads={hv} is not a multiple of model.linear_num_key_heads={hk}; allowed "
            f"values: multiples of {hk}"
        )


def check_moe_shapes(model: Mapping[str, Any]) -> None:
    """An MoE model's experts: 1 <= top-k <= experts (Megatron's router assert), positive expert sizes."""
    experts = _size(model, "num_experts")
    topk = _required(model, "moe_topk", "model")
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= experts:
        raise SettingsError(
            f"model.moe_topk={topk!r} is not allowed; allowed values: integers from 1 to model.num_experts={experts}"
        )
    _size(model, "moe_ffn_hidden_size")
    _size(model, "shared_expert_ffn_hidden_size", required=False)
    _number(_get(model, "moe_aux_loss_coeff", 0.0), "model.moe_aux_loss_coeff", 0.0)


def check_model_shapes(model: Mapping[str, Any]) -> None:
    """Every shape rule of ``model`` (the plain group), in the order a reader checks a config: depth and width,
    attention, then the GDN and MoE parts a model has."""
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "vocab_size"):
        _size(model, key)
    # A sequence is at least one prompt token and one response token.
    _size(model, "max_position_embeddings", 2)
    _number(_required(model, "norm_epsilon", "model"), "model.norm_epsilon", 0.0, open_low=True)
    _number(_get(model, "init_std", 0.02), "model.init_std", 0.0, open_low=True)
    check_attention(model)
    if _get(model, "full_attention_interval") is not None:
        check_gdn_shapes(model)
    if _get(model, "num_experts") is not None:
        check_moe_shapes(model)


def parameter_counts(model: Mapping[str, Any]) -> dict[str, int]:
    """Parameters of a checked model by part (``embedding``: input and output embeddings; ``layers``: attention,
    GDN, dense MLP, router and shared expert; ``experts``: the routed experts, split by EP), norms left out."""
    h, layers = model["hidden_size"], model["num_layers"]
    heads, groups, kv = model["num_attention_heads"], model["num_query_groups"], model["kv_channels"]
    gate = 2 if _get(model, "attention_output_gate", False) else 1
    attention = h * heads * kv * gate + 2 * h * groups * kv + heads * kv * h
    interval = _get(model, "full_attention_interval")
    if interval is None:
        n_attn = layers
    elif isinstance(interval, int):
        n_attn = layers // interval
    else:
        n_attn = sum(1 for t in interval if t == "full_attention")
    gdn = 0
    if interval is not None:
        hk, hv = model["linear_num_key_heads"], model["linear_num_value_heads"]
        dk, dv = model["linear_key_head_dim"], model["linear_value_head_dim"]
        conv = (2 * hk * dk + hv * dv) * model["linear_conv_kernel_dim"]
        gdn = h * (2 * hk * dk + 2 * hv * dv + 2 * hv) + conv + hv * dv * h
    experts = _get(model, "num_experts")
    if experts is None:
        mlp, routed = 3 * h * model["ffn_hidden_size"], 0
    else:
        shared = _get(model, "shared_expert_ffn_hidden_size") or 0
        mlp, routed = h * experts + 3 * h * shared, experts * 3 * h * model["moe_ffn_hidden_size"]
    tied = bool(_get(model, "tie_word_embeddings", False))
    return {
        "embedding": model["vocab_size"] * h * (1 if tied else 2),
        "layers": n_attn * attention + (layers - n_attn) * gdn + layers * mlp,
        "experts": layers * routed,
    }


def human_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit below it (``1.5 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"  # not reached
