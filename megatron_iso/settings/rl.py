"""The ``rl`` and ``rollout`` groups, typed and checked."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_iso.settings.correction import RolloutCorrection
from megatron_iso.settings.data import check_generation
from megatron_iso.settings.fields import (
    SettingsError,
    _bool,
    _choice,
    _get,
    _int,
    _number,
    _positive,
    _required,
    check_temperature,
)

# What a NaN or Inf in the rollout logprobs or the gradients does: stop the run, or skip the step's update.
NONFINITE_POLICIES = ("stop", "skip")
ALGOS = ("grpo", "dapo")  # rl.algo (rl.losses)
AGGREGATIONS = ("token_mean", "seq_mean_token_mean")  # rl.aggregation (rl.losses)
LR_DECAY_STYLES = ("constant", "linear", "cosine")  # rl.lr_decay_style (megatron_iso.rl.optim)
# Activation recompute (Megatron's TransformerConfig fields of the same names; models.transformer_config passes them on).
RECOMPUTE_GRANULARITIES = ("selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
# Selective recompute's submodules that the iso layers run under Megatron's checkpoint (CachedSelfAttention's
# core attention, TransformerLayer's dense MLP); the others need Transformer Engine or layers we do not build.
RECOMPUTE_MODULES = ("core_attn", "mlp")
# rl.recompute_old_logprobs: auto recomputes pi_old only where the rollout's logprobs are not the trainer's (the
# performance profile) and more than one update reads them (megatron_iso.rl.ppo).
RECOMPUTE_OLD_LOGPROBS = ("auto", "true", "false")


def check_micro_batch_seqs(value: Any) -> int:
    """``rl.train_micro_batch_seqs`` checked: sequences per trainer micro-batch, 0 = all in one batch."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SettingsError(
            f"rl.train_micro_batch_seqs={value!r} is not allowed; allowed values: 0 or null (all sequences "
            "in one batch) or a positive integer (sequences per micro-batch)"
        )
    return value


def check_backward_states(value: Any) -> str:
    """``rl.gdn_backward_states`` checked by the GDN family's rule (keep | recompute)."""
    from megatron_iso.ops.gdn import check_backward_states as check

    try:
        return check(str(value), "rl.gdn_backward_states")
    except ValueError as exc:  # the op family's rule, told as a setting's error (exit 2)
        raise SettingsError(str(exc)) from None


def check_rollout_correction(rl: Mapping[str, Any]) -> RolloutCorrection:
    """``rl.rollout_correction`` (mode, level, lower, upper) checked; ``rl.tis_cap > 0``, its former one knob, is
    ``mode=truncate, level=token, upper=tis_cap`` (with a deprecation warning), and refused beside another mode."""
    group = _get(rl, "rollout_correction", {})
    if not isinstance(group, Mapping):
        raise SettingsError(
            f"rl.rollout_correction={group!r} is not allowed; allowed values: a group of mode, level, lower, upper"
        )
    mode = _get(group, "mode", "off")
    mode = "off" if mode is False else mode  # YAML reads a bare `off` as false
    cap = _positive(_get(rl, "tis_cap", 0.0), "rl.tis_cap", zero=True)
    if cap > 0:
        if mode != "off":
            raise SettingsError(
                f"rl.tis_cap={cap} and rl.rollout_correction.mode={mode} both set a correction; rl.tis_cap is "
                "deprecated: set rl.rollout_correction.mode=truncate rl.rollout_correction.upper=<cap> only"
            )
        warnings.warn(
            f"rl.tis_cap is deprecated and will be removed; rl.tis_cap={cap} is now rl.rollout_correction.mode="
            f"truncate rl.rollout_correction.level=token rl.rollout_correction.upper={cap}",
            FutureWarning,
            stacklevel=2,
        )
        if cap < 1:
            raise SettingsError(f"rl.tis_cap={cap} is not allowed; allowed values: 0 (off) or numbers >= 1")
        return _correction(mode="truncate", level="token", upper=cap)
    upper = _get(group, "upper", 2.0)
    return _correction(mode=str(mode), level=str(_get(group, "level", "token")), lower=group.get("lower"), upper=upper)


def _correction(**fields: Any) -> RolloutCorrection:
    try:
        return RolloutCorrection(**fields)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def check_ppo(rl: Mapping[str, Any]) -> dict[str, Any]:
    """``rl.ppo_mini_batch_size`` (prompts per optimizer step, verl's unit; 0 or null: the whole batch),
    ``rl.ppo_epochs`` (>= 1) and ``rl.recompute_old_logprobs`` (auto | true | false) checked."""
    size = _get(rl, "ppo_mini_batch_size", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise SettingsError(
            f"rl.ppo_mini_batch_size={size!r} is not allowed; allowed values: 0 or null (the whole rollout batch) "
            "or a positive integer (prompts per optimizer step, each with its rl.group_size samples)"
        )
    recompute = _get(rl, "recompute_old_logprobs", "auto")
    recompute = str(recompute).lower() if isinstance(recompute, bool) else recompute  # Hydra reads true / false
    return {
        "ppo_mini_batch_size": size,
        "ppo_epochs": _int(_get(rl, "ppo_epochs", 1), "rl.ppo_epochs", 1),
        "recompute_old_logprobs": _choice(recompute, "rl.recompute_old_logprobs", RECOMPUTE_OLD_LOGPROBS),
    }


@dataclass
class RLSettings:
    """``rl`` (conf/rl/*.yaml), typed. Also the group's structured-config schema (defaults: rl/grpo.yaml)."""

    algo: str = "grpo"
    steps: int = 20
    group_size: int = 8
    # Sampling and stopping (megatron_iso.settings.data.check_generation): max_new_tokens is the deprecated name of
    # max_response_length (resolved, both hold the response limit).
    max_new_tokens: int | None = None
    max_response_length: int = 8
    max_prompt_length: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: list[int] | None = None
    val_every: int = 0
    val_before_train: bool = True
    val_temperature: float = 0.0
    val_n: int = 1
    log_entropy: bool = True
    lr: float = 0.02
    clip_low: float = 0.2
    clip_high: float = 0.2
    aggregation: str = "seq_mean_token_mean"
    kl_coef: float = 0.0
    tis_cap: float = 0.0  # deprecated: rollout_correction.mode=truncate, upper=tis_cap
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    ppo_mini_batch_size: int | None = 0  # prompts per optimizer step (verl's unit); 0: the whole batch
    ppo_epochs: int = 1
    recompute_old_logprobs: str = "auto"
    dynamic_sampling: bool = False
    max_gen_batches: int = 1  # rollout batches a dynamic-sampling step may generate to fill its groups
    routing_replay: bool = False  # MoE: the trainer routes each token as the rollout did (models.routing)
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    scale_adv_by_std: bool = True
    checkpoint_every: int = 10
    keep_checkpoints: int = 0  # complete run checkpoints kept (the newest); 0: all
    save_hf_every: int = 0  # write the policy as an HF directory (<run>/hf/step_N) every N steps; 0: never
    grad_clip: float = 1.0
    train_micro_batch_seqs: int | None = 0
    gdn_backward_states: str = "keep"
    nonfinite: str = "stop"
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"
    min_lr: float = 0.0
    weight_decay: float = 0.01
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: list[str] | None = None
    use_distributed_optimizer: bool = False


@dataclass(frozen=True)
class Recompute:
    """``rl.recompute_*`` checked: Megatron's TransformerConfig fields (all None: no recompute)."""

    granularity: str | None = None
    method: str | None = None
    num_layers: int | None = None
    modules: tuple[str, ...] | None = None


def check_recompute(rl: Mapping[str, Any]) -> Recompute:
    """``rl.recompute_granularity`` (null | selective | full); with full, ``rl.recompute_method`` (uniform | block)
    and ``rl.recompute_num_layers`` (>= 1); with selective, ``rl.recompute_modules`` (null: Megatron's default,
    core_attn). Keys that the chosen granularity does not read must stay null (Megatron refuses them too)."""
    granularity = _get(rl, "recompute_granularity")
    method, num_layers, modules = (
        _get(rl, k) for k in ("recompute_method", "recompute_num_layers", "recompute_modules")
    )
    if granularity is None:
        stray = [k for k, v in (("method", method), ("num_layers", num_layers), ("modules", modules)) if v is not None]
        if stray:
            raise SettingsError(f"rl.recompute_{stray[0]} is set but rl.recompute_granularity is null; set both")
        return Recompute()
    granularity = _choice(granularity, "rl.recompute_granularity", RECOMPUTE_GRANULARITIES)
    if granularity == "selective":
        if method is not None or num_layers is not None:
            raise SettingsError(
                "rl.recompute_method / rl.recompute_num_layers apply to rl.recompute_granularity=full only; "
                "leave them null with selective"
            )
        chosen = tuple(_choice(m, "rl.recompute_modules", RECOMPUTE_MODULES) for m in (modules or ("core_attn",)))
        return Recompute(granularity, modules=chosen)
    if modules is not None:
        raise SettingsError("rl.recompute_modules applies to rl.recompute_granularity=selective only; leave it null")
    if method is None or num_layers is None:
        raise SettingsError(
            "rl.recompute_granularity=full needs rl.recompute_method (allowed values: "
            f"{list(RECOMPUTE_METHODS)}) and rl.recompute_num_layers (integers >= 1)"
        )
    return Recompute(
        granularity,
        _choice(method, "rl.recompute_method", RECOMPUTE_METHODS),
        _int(num_layers, "rl.recompute_num_layers", 1),
    )


def resolve_rl(rl: Mapping[str, Any]) -> RLSettings:
    """``rl`` typed; every key the loop reads must be present (as when the loop read the DictConfig)."""

    def req(key: str) -> Any:
        return _required(rl, key, "rl")

    def flag(key: str, default: bool) -> bool:
        return _bool(_get(rl, key, default), f"rl.{key}")

    def at_least_zero(key: str) -> float:
        return _number(req(key), f"rl.{key}", 0.0)

    steps, lr, warmup = _int(req("steps"), "rl.steps", 1), _positive(req("lr"), "rl.lr"), _get(rl, "lr_warmup_steps", 0)
    if _int(warmup, "rl.lr_warmup_steps", 0) >= steps:
        raise SettingsError(f"rl.lr_warmup_steps={warmup} is not allowed; allowed values: 0 .. {steps - 1}")
    if _positive(_get(rl, "min_lr", 0.0), "rl.min_lr", zero=True) > lr:
        raise SettingsError(f"rl.min_lr={rl['min_lr']!r} is not allowed; allowed values: 0 .. rl.lr = {lr!r}")
    recompute = check_recompute(rl)
    return RLSettings(
        algo=_choice(req("algo"), "rl.algo", ALGOS),
        steps=steps,
        group_size=_int(req("group_size"), "rl.group_size", 2),
        **check_generation(rl),
        temperature=check_temperature(req("temperature"), "rl.temperature"),
        lr=lr,
        clip_low=at_least_zero("clip_low"),
        clip_high=at_least_zero("clip_high"),
        aggregation=_choice(req("aggregation"), "rl.aggregation", AGGREGATIONS),
        kl_coef=at_least_zero("kl_coef"),
        tis_cap=at_least_zero("tis_cap"),
        rollout_correction=check_rollout_correction(rl),
        **check_ppo(rl),
        dynamic_sampling=flag("dynamic_sampling", False),
        max_gen_batches=_int(_get(rl, "max_gen_batches", 1), "rl.max_gen_batches", 1),
        routing_replay=flag("routing_replay", False),
        overlong_buffer=_int(req("overlong_buffer"), "rl.overlong_buffer", 0),
        overlong_penalty=at_least_zero("overlong_penalty"),
        scale_adv_by_std=flag("scale_adv_by_std", True),
        checkpoint_every=_int(req("checkpoint_every"), "rl.checkpoint_every", 1),
        keep_checkpoints=_int(_get(rl, "keep_checkpoints", 0), "rl.keep_checkpoints", 0),
        save_hf_every=_int(_get(rl, "save_hf_every", 0), "rl.save_hf_every", 0),
        grad_clip=at_least_zero("grad_clip"),
        train_micro_batch_seqs=check_micro_batch_seqs(rl.get("train_micro_batch_seqs")),
        gdn_backward_states=check_backward_states(_get(rl, "gdn_backward_states", "keep")),
        nonfinite=_choice(_get(rl, "nonfinite", "stop"), "rl.nonfinite", NONFINITE_POLICIES),
        lr_warmup_steps=warmup,
        lr_decay_style=_choice(_get(rl, "lr_decay_style", "constant"), "rl.lr_decay_style", LR_DECAY_STYLES),
        min_lr=float(_get(rl, "min_lr", 0.0)),
        weight_decay=_positive(_get(rl, "weight_decay", 0.01), "rl.weight_decay", zero=True),
        recompute_granularity=recompute.granularity,
        recompute_method=recompute.method,
        recompute_num_layers=recompute.num_layers,
        recompute_modules=None if recompute.modules is None else list(recompute.modules),
        use_distributed_optimizer=flag("use_distributed_optimizer", False),
    )


@dataclass(frozen=True)
class RolloutSettings:
    """``rollout``: the bundled decoder. ``parallel``: ``rollout.parallel`` as given (its keys over the trainer's
    ``parallel`` make the rollout's layout, once the world size is known: :func:`megatron_iso.settings.rollout_layout`)."""

    kv_cache_mb: int
    paged_kv_reads: bool
    cuda_graphs: bool
    release_in_training: bool
    parallel: Mapping[str, Any] = field(default_factory=dict)

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache_mb << 20


def resolve_rollout(rollout: Mapping[str, Any]) -> RolloutSettings:
    return RolloutSettings(
        kv_cache_mb=_int(_required(rollout, "kv_cache_mb", "rollout"), "rollout.kv_cache_mb", 1),
        paged_kv_reads=_bool(_get(rollout, "paged_kv_reads", True), "rollout.paged_kv_reads"),
        cuda_graphs=_bool(_get(rollout, "cuda_graphs", True), "rollout.cuda_graphs"),
        release_in_training=_bool(_get(rollout, "release_in_training", True), "rollout.release_in_training"),
        parallel=dict(_get(rollout, "parallel", {})),
    )


def check_routing_replay(rl: RLSettings | None, moe: object | None, sequence_parallel: bool) -> None:
    """``rl.routing_replay=true`` needs routed experts to replay (an MoE model) and a rollout that records them
    (no sequence parallelism: each TP rank would route only a share of a step's rows)."""
    if rl is None or not rl.routing_replay:
        return
    if moe is None:
        raise SettingsError(
            "rl.routing_replay=true needs an MoE model (model.num_experts set); this model is dense: set "
            "rl.routing_replay=false"
        )
    if sequence_parallel:
        raise SettingsError(
            "rl.routing_replay=true is not supported with parallel.sp=true (the rollout records routing without "
            "sequence parallelism); set parallel.sp=false"
        )


def ppo_mini_batches(rl: RLSettings | None, prompts_per_step: int | None) -> int:
    """Optimizer steps per PPO epoch: ``task.prompts_per_step / rl.ppo_mini_batch_size`` (1 for 0 / null, the whole
    batch; 1 without an rl or task group); refused unless it divides."""
    if rl is None or prompts_per_step is None:
        return 1
    size = rl.ppo_mini_batch_size or prompts_per_step
    if prompts_per_step % size:
        divisors = [d for d in range(1, prompts_per_step + 1) if prompts_per_step % d == 0]
        raise SettingsError(
            f"rl.ppo_mini_batch_size={size} does not divide task.prompts_per_step={prompts_per_step}; allowed "
            f"values: 0 (the whole batch) or a divisor of {prompts_per_step}: {divisors}"
        )
    return prompts_per_step // size
