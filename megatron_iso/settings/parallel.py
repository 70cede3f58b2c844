"""The ``parallel`` group, typed and checked, and the one rule of which degrees Megatron can shard a model at
(:func:`check_shardable`, :func:`shard_degrees`; the contract's invariance domains read the same rule)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_iso.settings.fields import SettingsError, _bool, _get, _int

# Model sizes a parallel degree must divide for Megatron to shard the model at all. TP splits the attention heads and
# query groups, the GDN key and value heads, the dense and shared-expert FFN (column- then row-parallel) and the vocab
# (embedding and LM head, never padded); EP splits the routed experts (never split by TP).
SHARDED_BY: dict[str, tuple[str, ...]] = {
    "tp": (
        "num_attention_heads",
        "num_query_groups",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "ffn_hidden_size",
        "shared_expert_ffn_hidden_size",
        "vocab_size",
    ),
    "ep": ("num_experts",),
}
# What a model without any of an axis's sizes is, for check_shardable's error.
_NOTHING_TO_SHARD = {"ep": "a dense model: it has no routed experts (model.num_experts is not set)"}


def _sharded_sizes(model: Mapping[str, Any], axis: str) -> dict[str, int]:
    """The sizes of ``model`` that ``parallel.<axis>`` splits (the positive integers among :data:`SHARDED_BY`)."""
    sizes = {k: model.get(k) for k in SHARDED_BY.get(axis, ())}
    return {k: v for k, v in sizes.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}


def _shards_at(sizes: Mapping[str, int], degree: int) -> bool:
    """Whether Megatron can shard a model whose sizes split by an axis are ``sizes`` (:func:`_sharded_sizes`) at
    ``degree``: one dividing every size; with none of them (a dense model's EP) degree 1 only. The one rule behind
    the layout check (:func:`check_shardable`) and the contract's invariance domains (:func:`shard_degrees`), so a
    contract claims no layout the trainer refuses."""
    if not sizes:
        return degree == 1
    return all(size % degree == 0 for size in sizes.values())


def shard_degrees(model: Mapping[str, Any], axis: str, candidates: Sequence[int] | None = None) -> list[int]:
    """The degrees of ``parallel.<axis>`` among ``candidates`` (default: 1 up to the smallest sharded size) at which
    Megatron can shard ``model`` (:func:`_shards_at`): those dividing every size :data:`SHARDED_BY` names for the
    axis. An axis that splits none of the model's sizes (EP of a dense model) keeps degree 1 only, as
    :func:`check_shardable` refuses any other: the contract's invariance domain of that axis is ``[1]``."""
    sizes = _sharded_sizes(model, axis)
    if candidates is None:
        candidates = range(1, min(sizes.values(), default=1) + 1)
    return [d for d in candidates if _shards_at(sizes, d)]


def check_shardable(
    model: Mapping[str, Any],
    axis: str,
    degree: int,
    field_name: str | None = None,
    candidates: Sequence[int] | None = None,
) -> None:
    """Refuse a ``parallel.<axis>`` degree (a positive int) at which Megatron cannot shard ``model``
    (:func:`_shards_at`): the one sharding check of the trainer's layout (:func:`resolve_parallel`) and the
    rollout's (``rollout.parallel.tp``), whose rule also narrows the contract's invariance domains
    (:func:`shard_degrees`). The error names ``field_name`` (default ``parallel.<axis>``), the sizes the degree does
    not divide and the allowed degrees among ``candidates``. A model with none of the sizes the axis splits (a dense
    model's EP) takes degree 1 only."""
    sizes = _sharded_sizes(model, axis)
    if _shards_at(sizes, degree):
        return
    if not sizes:
        names = ", ".join(f"model.{k}" for k in SHARDED_BY.get(axis, ()))
        what = _NOTHING_TO_SHARD.get(axis, f"this model: it sets none of {names}")
        raise SettingsError(
            f"{field_name or f'parallel.{axis}'}={degree} does not apply to {what}; allowed values: [1]"
        )
    shown = ", ".join(f"model.{k}={v}" for k, v in sizes.items() if v % degree)
    raise SettingsError(
        f"{field_name or f'parallel.{axis}'}={degree} does not divide {shown}: Megatron cannot shard this model "
        f"that way; allowed values: {shard_degrees(model, axis, candidates)}"
    )


@dataclass
class ParallelSettings:
    """``parallel`` (conf/parallel/*.yaml). Also the group's structured-config schema."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    sp: bool = False
    dp: int | None = None  # data parallel: null derives it from the world size (world / (tp * pp)); a value must agree
    cp: int = 1  # context parallelism: the trainer's packs split over CP ranks (parallel.context), in CP_DEGREES


CP_DEGREES = (1, 2, 4, 8)


def cp_degrees(model: Mapping[str, Any], candidates: Sequence[int] = CP_DEGREES) -> list[int]:
    """The ``parallel.cp`` degrees among ``candidates`` that ``model`` runs at: every one of :data:`CP_DEGREES`, for
    attention-only models and Gated DeltaNet hybrids alike (``models.gdn_context``: the GDN layers pass their state
    rank to rank, or run the whole pack on every CP rank where the rule carries none). The layout check and the
    contract's ``cp_domain`` both read it."""
    return [d for d in candidates if d in CP_DEGREES]


def check_cp(model: Mapping[str, Any] | None, parallel: ParallelSettings) -> None:
    """Refuse a ``parallel.cp`` outside :data:`CP_DEGREES`, or one with a pipeline (every model family runs every
    degree: :func:`cp_degrees`)."""
    cp = parallel.cp
    if cp not in CP_DEGREES:
        raise SettingsError(f"parallel.cp={cp} is not allowed; allowed values: {list(CP_DEGREES)}")
    if cp == 1:
        return
    if parallel.pp != 1:
        raise SettingsError(f"parallel.cp={cp} with parallel.pp={parallel.pp}: a pipelined trainer runs CP 1; "
                            "allowed values: [1]")  # fmt: skip


def resolve_parallel(parallel: Mapping[str, Any], model: Mapping[str, Any] | None = None) -> ParallelSettings:
    """``parallel`` checked: every degree a positive integer; with ``model``, TP and EP degrees that divide the
    sizes Megatron shards by them (:func:`check_shardable`) and a CP degree the model runs (:func:`check_cp`)."""
    out = ParallelSettings(
        tp=_int(_get(parallel, "tp", 1), "parallel.tp", 1),
        pp=_int(_get(parallel, "pp", 1), "parallel.pp", 1),
        ep=_int(_get(parallel, "ep", 1), "parallel.ep", 1),
        sp=_bool(_get(parallel, "sp", False), "parallel.sp"),
        dp=None if parallel.get("dp") is None else _int(parallel["dp"], "parallel.dp", 1),
        cp=_int(_get(parallel, "cp", 1), "parallel.cp", 1),
    )
    check_cp(model, out)
    for axis in SHARDED_BY if model is not None else ():
        check_shardable(model, axis, getattr(out, axis))
    return out
