"""The one reading of the Hydra config: the composed DictConfig, validated once into typed settings.

:func:`resolve` turns the root config (``megatron_iso/conf/``) into :class:`Settings`: typed groups (``model``, ``parallel``,
``rl``, ``rollout``, the run's ``seed`` / ``out_dir`` / ``resume``) and a resolved :class:`ProfileSettings`: the
device class from ``device: auto|cpu|cuda``, the GDN output form from ``profile.gdn_form: auto|scan|chunk`` and its
dot precision (the GDN op family says which forms exist where), the leaves the layers use. Errors name the field
and the allowed values.

Layering: this module sits above ``ops`` and ``contract``: it may ask the op families (lazily) and fills the contract
builder's :class:`~megatron_iso.contract.build.ContractInputs`, which the builder and ``models/config.py`` read.
:func:`contract_for` is every tool's one way from a config to its contract: it loads every registered implementation.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from megatron_iso.contract.build import (
    SHARDED_BY,
    ContractInputs,
    ContractValidationError,
    check_profile_name,
    plain_config,
    resolve_device_class,
)
from megatron_iso.contract.build import build_contract as _build_contract
from megatron_iso.contract.build import check_gpu_gemm_shapes as _check_gpu_gemm_shapes
from megatron_iso.contract.loader import load_op_implementations
from megatron_iso.contract.registry import Profile
from megatron_iso.contract.schema import Contract
from megatron_iso.errors import UserError

HF_GDN_LAYOUTS = ("qkvz", "split")
PARAMS_DTYPES = ("bf16", "fp32")
# resume=false starts a run, true continues the latest checkpoint (an error without one), auto either.
RESUME_MODES = ("false", "true", "auto")
# What a NaN or Inf in the rollout logprobs or the gradients does: stop the run, or skip the step's update.
NONFINITE_POLICIES = ("stop", "skip")
LR_DECAY_STYLES = ("constant", "linear", "cosine")  # rl.lr_decay_style (megatron_iso.rl.optim)


class SettingsError(UserError, ValueError):
    """A setting outside its allowed values; the message names the field and the values."""


def resume_mode(value: Any) -> str:
    """``resume`` as one of :data:`RESUME_MODES` (Hydra reads ``true`` / ``false`` as booleans)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value).strip().lower()
    if text not in RESUME_MODES:
        raise SettingsError(f"resume={value!r} is not allowed; allowed values: {list(RESUME_MODES)}")
    return text


def check_out_dir(value: Any) -> Path | None:
    """``out_dir`` as a path; None (the default) lets the run make a new ``runs/<UTC time>-<id>``."""
    if value is None:
        return None
    if not str(value).strip():
        raise SettingsError(
            f"out_dir={value!r} is not allowed; allowed values: a directory path, or null for a new runs/<time>-<id>"
        )
    return Path(str(value))


LOGGERS = ("none", "wandb")
WANDB_MODES = ("offline", "online", "disabled")


def check_logger(logger: Mapping[str, Any] | None) -> tuple[str, str]:
    """``(logger.name, logger.mode)`` checked (mode: W&B's; offline unless set)."""
    name = _choice(_get(logger, "name", "none"), "logger.name", LOGGERS)
    mode = _choice(_get(logger, "mode", "offline"), "logger.mode", WANDB_MODES)
    return name, mode


def _int(value: Any, field_name: str, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; anything else names the field and what it takes."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SettingsError(f"{field_name}={value!r} is not allowed; allowed values: integers >= {minimum}")
    return value


def _positive(value: Any, field_name: str, zero: bool = False) -> float:
    """``value`` as a finite float > 0 (>= 0 with ``zero``)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and (value >= 0 if zero else value > 0)
    if not (ok and float(value) < float("inf")):
        bound = ">= 0" if zero else "> 0"
        raise SettingsError(f"{field_name}={value!r} is not allowed; allowed values: finite numbers {bound}")
    return float(value)


def _choice(value: Any, field_name: str, allowed: tuple[str, ...]) -> str:
    if str(value) not in allowed:
        raise SettingsError(f"{field_name}={value!r} is not allowed; allowed values: {list(allowed)}")
    return str(value)


def _get(group: Mapping[str, Any] | None, key: str, default: Any = None) -> Any:
    """``group[key]``, or ``default`` when the group, the key or its value is missing (null)."""
    value = None if group is None else group.get(key)
    return default if value is None else value


def _group(c: Mapping[str, Any], key: str) -> dict[str, Any]:
    group = c.get(key)
    if not isinstance(group, Mapping):
        raise ContractValidationError(
            f"config has no '{key}' group; compose the root config (megatron_iso/conf/config.yaml)"
        )
    return dict(group)


# --- profile -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileSettings:
    """``profile`` resolved for one device class. ``raw``: the group as the contract pins it (form resolved)."""

    name: Profile
    device_class: str  # "cpu" or "cuda", never "auto"
    leaves: int  # row-parallel GEMMs' and the vocab LSE's leaves the layers use (1 outside correctness)
    expert_leaves: int  # routed experts' down projection (1 outside correctness)
    attention_kv_block: int  # keys reduced in blocks of this many positions (0 in the profile: 64)
    gdn_chunk: int
    gdn_form: str  # "scan" or "chunk", never "auto"
    gdn_dot_precision: str | None
    raw: Mapping[str, Any] = field(repr=False, default_factory=dict)

    @property
    def bitwise(self) -> bool:
        return self.name is Profile.CORRECTNESS


def resolve_gdn_form(profile: Mapping[str, Any], device_class: str) -> tuple[str, str | None]:
    """(gdn_form, gdn_dot_precision) of ``profile`` on ``device_class``: "auto" resolved by the GDN family."""
    from megatron_iso.ops.gdn import gdn_profile_fields

    try:
        return gdn_profile_fields(profile, device_class)
    except ValueError as e:
        raise ContractValidationError(str(e)) from None


def check_gdn_choice_runs_here(profile: ProfileSettings) -> None:
    """Refuse a GDN (form, dot precision) where its kernels do not run, rather than write a contract whose
    composition computes something else (docs/GDN.md "Output forms"). The contract's check: a model config may
    still carry such a choice (its op then refuses to run)."""
    from megatron_iso.ops.gdn import gdn_choice_runs_here

    form, precision, device_class = profile.gdn_form, profile.gdn_dot_precision, profile.device_class
    if not gdn_choice_runs_here(form, precision, device_class, profile.name.value):
        raise ContractValidationError(
            f"profile.gdn_form={form!r}, profile.gdn_dot_precision={precision!r} need device=cuda and profile "
            f"correctness (the Triton GDN kernels); on device_class={device_class!r} with profile {profile.name.value!r} "
            "only gdn_form='scan' (or 'auto') with gdn_dot_precision=null exists"
        )


def resolve_profile(profile: Mapping[str, Any], device: Any) -> ProfileSettings:
    """``profile`` and ``device`` resolved (order of checks: device, profile.name, the GDN choice)."""
    device_class = resolve_device_class(device)
    name = check_profile_name(profile.get("name"))
    form, precision = resolve_gdn_form(profile, device_class)
    chunk = int(_get(profile, "gdn_chunk", 64))
    if chunk < 1:
        raise ContractValidationError(f"profile.gdn_chunk={chunk} must be a positive int")
    bitwise = name is Profile.CORRECTNESS
    raw = {**profile, "gdn_form": form} if "gdn_form" in profile else dict(profile)
    return ProfileSettings(
        name=name,
        device_class=device_class,
        leaves=int(_get(profile, "leaves", 8)) if bitwise else 1,
        expert_leaves=int(_get(profile, "expert_leaves", 1)) if bitwise else 1,
        attention_kv_block=int(_get(profile, "attention_kv_block", 64)) or 64,
        gdn_chunk=chunk,
        gdn_form=form,
        gdn_dot_precision=precision,
        raw=raw,
    )


# --- model -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GDNSettings:
    """A hybrid model's Gated DeltaNet layers (``full_attention_interval`` set)."""

    full_attention_interval: int
    conv_kernel_dim: int
    key_head_dim: int
    value_head_dim: int
    num_key_heads: int
    num_value_heads: int
    hf_layout: str  # model.hf_gdn_layout: "qkvz" (Qwen3-Next) or "split" (Qwen3.5); naming only


@dataclass(frozen=True)
class MoESettings:
    """An MoE model's experts (``num_experts`` set)."""

    num_experts: int
    topk: int
    ffn_hidden_size: int
    shared_expert_ffn_hidden_size: int | None
    shared_expert_gate: bool
    norm_topk_prob: bool
    aux_loss_coeff: float


@dataclass(frozen=True)
class ModelSettings:
    """``model``, typed. ``raw``: the plain group (the contract's semantic identity reads every key)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    norm_epsilon: float
    zero_centered_norm: bool
    qk_layernorm: bool
    attention_output_gate: bool
    init_std: float
    rope_theta: float
    rotary_fraction: float
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    params_dtype: str
    gdn: GDNSettings | None
    moe: MoESettings | None
    raw: Mapping[str, Any] = field(repr=False, default_factory=dict)


def resolve_gdn(model: Mapping[str, Any]) -> GDNSettings | None:
    """The GDN fields of a hybrid model (one with ``full_attention_interval``); None otherwise."""
    interval = _get(model, "full_attention_interval")
    if interval is None:
        return None
    if int(interval) < 1:
        raise ValueError(f"model.full_attention_interval={interval} must be >= 1")
    layout = str(_get(model, "hf_gdn_layout", "qkvz"))
    if layout not in HF_GDN_LAYOUTS:
        raise ValueError(f"model.hf_gdn_layout={layout!r} is not allowed; allowed values: {list(HF_GDN_LAYOUTS)}")
    return GDNSettings(
        full_attention_interval=int(interval),
        conv_kernel_dim=int(model["linear_conv_kernel_dim"]),
        key_head_dim=int(model["linear_key_head_dim"]),
        value_head_dim=int(model["linear_value_head_dim"]),
        num_key_heads=int(model["linear_num_key_heads"]),
        num_value_heads=int(model["linear_num_value_heads"]),
        hf_layout=layout,
    )


def resolve_moe(model: Mapping[str, Any]) -> MoESettings | None:
    experts = _get(model, "num_experts")
    if experts is None:
        return None
    shared = _get(model, "shared_expert_ffn_hidden_size")
    return MoESettings(
        num_experts=int(experts),
        topk=int(model["moe_topk"]),
        ffn_hidden_size=int(model["moe_ffn_hidden_size"]),
        shared_expert_ffn_hidden_size=None if shared is None else int(shared),
        shared_expert_gate=bool(_get(model, "shared_expert_gate", False)),
        norm_topk_prob=bool(_get(model, "norm_topk_prob", True)),
        aux_loss_coeff=float(_get(model, "moe_aux_loss_coeff", 0.0)),
    )


def resolve_model(model: Mapping[str, Any]) -> ModelSettings:
    dtype = str(_get(model, "params_dtype", "fp32"))
    if dtype not in PARAMS_DTYPES:
        raise ValueError(f"model.params_dtype={dtype!r} is not allowed; allowed values: {sorted(PARAMS_DTYPES)}")
    gdn, moe = resolve_gdn(model), resolve_moe(model)
    return ModelSettings(
        num_layers=int(model["num_layers"]),
        hidden_size=int(model["hidden_size"]),
        ffn_hidden_size=int(model["ffn_hidden_size"]),
        num_attention_heads=int(model["num_attention_heads"]),
        num_query_groups=int(model["num_query_groups"]),
        kv_channels=int(model["kv_channels"]),
        norm_epsilon=float(model["norm_epsilon"]),
        zero_centered_norm=bool(_get(model, "zero_centered_norm", False)),
        qk_layernorm=bool(_get(model, "qk_layernorm", True)),
        attention_output_gate=bool(_get(model, "attention_output_gate", False)),
        init_std=float(_get(model, "init_std", 0.02)),
        rope_theta=float(model["rope_theta"]),
        rotary_fraction=float(_get(model, "rotary_fraction", 1.0)),
        vocab_size=int(model["vocab_size"]),
        max_position_embeddings=int(model["max_position_embeddings"]),
        tie_word_embeddings=bool(_get(model, "tie_word_embeddings", False)),
        params_dtype=dtype,
        gdn=gdn,
        moe=moe,
        raw=dict(model),
    )


# --- parallel, rl, rollout ---------------------------------------------------------------------------------------


@dataclass
class ParallelSettings:
    """``parallel`` (megatron_iso/conf/parallel/*.yaml). Also the group's structured-config schema."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    sp: bool = False
    dp: int = 1


def resolve_parallel(parallel: Mapping[str, Any], model: Mapping[str, Any] | None = None) -> ParallelSettings:
    """``parallel`` checked: every degree a positive integer; with ``model``, TP and EP degrees that divide the
    sizes Megatron shards by them (an error lists the degrees that would)."""
    out = ParallelSettings(
        tp=_int(_get(parallel, "tp", 1), "parallel.tp", 1),
        pp=_int(_get(parallel, "pp", 1), "parallel.pp", 1),
        ep=_int(_get(parallel, "ep", 1), "parallel.ep", 1),
        sp=bool(_get(parallel, "sp", False)),
        dp=_int(_get(parallel, "dp", 1), "parallel.dp", 1),
    )
    for axis, keys in SHARDED_BY.items() if model is not None else ():
        sizes = {k: model[k] for k in keys if isinstance(model.get(k), int) and model[k] > 0}
        degree = getattr(out, axis)
        if sizes and any(size % degree for size in sizes.values()):
            fits = [d for d in range(1, min(sizes.values()) + 1) if all(size % d == 0 for size in sizes.values())]
            shown = ", ".join(f"model.{k}={v}" for k, v in sizes.items())
            raise SettingsError(
                f"parallel.{axis}={degree} does not divide {shown}: Megatron cannot shard this model that way; "
                f"allowed values: {fits}"
            )
    return out


def check_micro_batch_seqs(value: Any) -> int:
    """``rl.train_micro_batch_seqs`` checked: sequences per trainer micro-batch, 0 = all in one batch."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"rl.train_micro_batch_seqs={value!r} is not allowed; allowed values: 0 or null (all sequences "
            "in one batch) or a positive integer (sequences per micro-batch)"
        )
    return value


def check_backward_states(value: Any) -> str:
    """``rl.gdn_backward_states`` checked by the GDN family's rule (keep | recompute)."""
    from megatron_iso.ops.gdn import check_backward_states as check

    return check(str(value), "rl.gdn_backward_states")


@dataclass
class RLSettings:
    """``rl`` (megatron_iso/conf/rl/*.yaml), typed. Also the group's structured-config schema (defaults: rl/grpo.yaml)."""

    algo: str = "grpo"
    steps: int = 20
    group_size: int = 8
    max_new_tokens: int = 8
    temperature: float = 1.0
    lr: float = 0.02
    clip_low: float = 0.2
    clip_high: float = 0.2
    aggregation: str = "seq_mean_token_mean"
    kl_coef: float = 0.0
    tis_cap: float = 0.0
    dynamic_sampling: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    scale_adv_by_std: bool = True
    checkpoint_every: int = 10
    grad_clip: float = 1.0
    train_micro_batch_seqs: int | None = 0
    gdn_backward_states: str = "keep"
    nonfinite: str = "stop"
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"
    min_lr: float = 0.0
    weight_decay: float = 0.01


def resolve_rl(rl: Mapping[str, Any]) -> RLSettings:
    """``rl`` typed; every key the loop reads must be present (as when the loop read the DictConfig)."""
    steps, lr, warmup = _int(rl["steps"], "rl.steps", 1), _positive(rl["lr"], "rl.lr"), _get(rl, "lr_warmup_steps", 0)
    if _int(warmup, "rl.lr_warmup_steps", 0) >= steps:
        raise SettingsError(f"rl.lr_warmup_steps={warmup} is not allowed; allowed values: 0 .. {steps - 1}")
    if _positive(_get(rl, "min_lr", 0.0), "rl.min_lr", zero=True) > lr:
        raise SettingsError(f"rl.min_lr={rl['min_lr']!r} is not allowed; allowed values: 0 .. rl.lr = {lr!r}")
    return RLSettings(
        algo=str(rl["algo"]),
        steps=steps,
        group_size=_int(rl["group_size"], "rl.group_size", 2),
        max_new_tokens=_int(rl["max_new_tokens"], "rl.max_new_tokens", 1),
        temperature=_positive(rl["temperature"], "rl.temperature"),
        lr=lr,
        clip_low=float(rl["clip_low"]),
        clip_high=float(rl["clip_high"]),
        aggregation=str(rl["aggregation"]),
        kl_coef=float(rl["kl_coef"]),
        tis_cap=float(rl["tis_cap"]),
        dynamic_sampling=bool(rl["dynamic_sampling"]),
        overlong_buffer=int(rl["overlong_buffer"]),
        overlong_penalty=float(rl["overlong_penalty"]),
        scale_adv_by_std=bool(rl["scale_adv_by_std"]),
        checkpoint_every=_int(rl["checkpoint_every"], "rl.checkpoint_every", 1),
        grad_clip=float(rl["grad_clip"]),
        train_micro_batch_seqs=check_micro_batch_seqs(rl.get("train_micro_batch_seqs")),
        gdn_backward_states=check_backward_states(_get(rl, "gdn_backward_states", "keep")),
        nonfinite=_choice(_get(rl, "nonfinite", "stop"), "rl.nonfinite", NONFINITE_POLICIES),
        lr_warmup_steps=warmup,
        lr_decay_style=_choice(_get(rl, "lr_decay_style", "constant"), "rl.lr_decay_style", LR_DECAY_STYLES),
        min_lr=float(_get(rl, "min_lr", 0.0)),
        weight_decay=_positive(_get(rl, "weight_decay", 0.01), "rl.weight_decay", zero=True),
    )


@dataclass(frozen=True)
class RolloutSettings:
    """``rollout``: the bundled decoder. (``rollout.parallel`` is read by :mod:`megatron_iso.rl.rollout`.)"""

    kv_cache_mb: int
    paged_kv_reads: bool
    cuda_graphs: bool

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache_mb << 20


def resolve_rollout(rollout: Mapping[str, Any]) -> RolloutSettings:
    return RolloutSettings(
        kv_cache_mb=_int(rollout["kv_cache_mb"], "rollout.kv_cache_mb", 1),
        paged_kv_reads=bool(rollout["paged_kv_reads"]),
        cuda_graphs=bool(rollout["cuda_graphs"]),
    )


# --- the whole config --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """The composed config, resolved. Groups a caller's config lacks (a bare model/profile/parallel mapping in a
    test or tool) are None; :meth:`require` names the missing one."""

    profile: ProfileSettings
    model: ModelSettings
    parallel: ParallelSettings
    contract: ContractInputs
    gdn_backward_states: str  # rl.gdn_backward_states (default "keep"): the model config reads it without rl
    rl: RLSettings | None = None
    rollout: RolloutSettings | None = None
    seed: int | None = None
    out_dir: Path | None = None  # None: the run makes a new directory (rl.run_dir.default_run_dir)
    resume: str = "false"  # one of RESUME_MODES
    dist_timeout_s: float | None = None  # collectives' timeout (dist_timeout_s); None: torch's default

    @property
    def device_class(self) -> str:
        return self.profile.device_class

    def require(self, name: str) -> Any:
        value = getattr(self, name)
        if value is None:
            raise ContractValidationError(
                f"config has no '{name}' group; compose the root config (megatron_iso/conf/config.yaml)"
            )
        return value


def contract_inputs(cfg: DictConfig | Mapping[str, Any]) -> ContractInputs:
    """What the contract builder reads, from a raw config (checks in the builder's order: groups, device,
    profile name, the profile against the model, the GDN choice)."""
    from megatron_iso.contract.build import validate_profile

    c = plain_config(cfg)
    model, profile, parallel = _group(c, "model"), _group(c, "profile"), _group(c, "parallel")
    device_class = resolve_device_class(c.get("device", "auto"))
    validate_profile(profile, model)
    resolved = resolve_profile(profile, device_class)
    check_gdn_choice_runs_here(resolved)
    return ContractInputs(device_class, resolved.raw, model, parallel, dict(c.get("contract") or {}))


def resolve(cfg: DictConfig | Mapping[str, Any] | Settings) -> Settings:
    """The one reading of ``cfg`` (a composed root config, or a mapping holding at least model, profile and
    parallel); a :class:`Settings` is returned as it is."""
    if isinstance(cfg, Settings):
        return cfg
    c = plain_config(cfg)
    model, profile, parallel = _group(c, "model"), _group(c, "profile"), _group(c, "parallel")
    resolved = resolve_profile(profile, c.get("device", "auto"))
    rl = c.get("rl")
    rl_settings = resolve_rl(rl) if isinstance(rl, Mapping) else None
    if isinstance(c.get("logger"), Mapping):
        check_logger(c["logger"])
    rollout = c.get("rollout")
    return Settings(
        profile=resolved,
        model=resolve_model(model),
        parallel=resolve_parallel(parallel, model),
        contract=ContractInputs(resolved.device_class, resolved.raw, model, parallel, dict(c.get("contract") or {})),
        gdn_backward_states=rl_settings.gdn_backward_states if rl_settings else "keep",
        rl=rl_settings,
        rollout=resolve_rollout(rollout) if isinstance(rollout, Mapping) else None,
        seed=None if c.get("seed") is None else int(c["seed"]),
        out_dir=check_out_dir(c.get("out_dir")),
        resume=resume_mode(c.get("resume", False)),
        dist_timeout_s=None if c.get("dist_timeout_s") is None else _positive(c["dist_timeout_s"], "dist_timeout_s"),
    )


def check_runs_here(settings: Settings) -> None:
    """What any run of the model needs beyond a valid config: one pipeline stage, a CUDA device for ``device=cuda``."""
    if settings.parallel.pp != 1:
        raise SettingsError(
            f"parallel.pp={settings.parallel.pp}: the trainer does not run pipeline parallelism yet; allowed values: [1]"
        )
    if settings.device_class == "cuda" and not torch.cuda.is_available():
        raise SettingsError("device=cuda but no CUDA device is visible; allowed values here: ['cpu', 'auto']")


def check_trainable(settings: Settings) -> None:
    """Before any world or model is built: an ``out_dir`` when ``resume`` continues one, :func:`check_runs_here`."""
    if settings.out_dir is None and settings.resume != "false":
        raise SettingsError(
            f"resume={settings.resume} needs the out_dir of the run to continue (without one, every run gets a new "
            "runs/<time>-<id>); set out_dir=..."
        )
    check_runs_here(settings)


def config_world(cfg: DictConfig | Mapping[str, Any] | Settings) -> AbstractContextManager[int]:
    """``parallel.world.launched_world`` for a config, from its settings: ``parallel.tp/pp/ep``, ``seed`` and
    ``dist_timeout_s``. The one way a config-driven launch (iso-train, tools/bench_rl_step.py) opens its world."""
    from megatron_iso.parallel.world import launched_world

    s = resolve(cfg)
    p = s.parallel
    return launched_world(p.tp, p.pp, p.ep, s.require("seed"), timeout_s=s.dist_timeout_s)


def gemm_block_k() -> Mapping[str, int]:
    """The GPU leaf-tree GEMMs' K tile per params dtype (the GEMM family's constant)."""
    from megatron_iso.ops.gemm.tiles import TRITON_BLOCK_K

    return TRITON_BLOCK_K


def contract_for(
    cfg: DictConfig | Mapping[str, Any] | Settings, impls: Any = None, *, load_implementations: bool = True
) -> Contract:
    """The contract of ``cfg``: every registered implementation loaded (``contract.load_op_implementations``:
    the op families and the parallel layer's collectives and embedding), the config resolved and checked,
    the contract built. ``impls``: an explicit composition instead of the registry's (tests, iso-gate);
    ``load_implementations=False`` for a caller that has loaded its own set (iso-gate's candidates)."""
    if load_implementations and impls is None:
        load_op_implementations()
    return _build_contract(_checked_contract_inputs(cfg), impls)


def check_gpu_gemm_shapes(cfg: DictConfig | Mapping[str, Any] | Settings) -> None:
    """:func:`megatron_iso.contract.build.check_gpu_gemm_shapes` with the GEMM family's K tiles."""
    _check_gpu_gemm_shapes(_checked_contract_inputs(cfg), gemm_block_k())


def _checked_contract_inputs(cfg: DictConfig | Mapping[str, Any] | Settings) -> ContractInputs:
    """The contract's inputs, checked as :func:`contract_inputs` checks a raw config."""
    if not isinstance(cfg, Settings):
        return contract_inputs(cfg)
    from megatron_iso.contract.build import validate_profile

    validate_profile(cfg.contract.profile, cfg.contract.model)
    check_gdn_choice_runs_here(cfg.profile)
    return cfg.contract


# Structured-config schemas of the groups whose keys are fixed (validation of the YAML files against them:
# tests/test_settings.py). Stored under schema/ only: the megatron_iso/conf/ groups' defaults and keys stay as they are.
_STORE = ConfigStore.instance()
_STORE.store(group="schema", name="rl", node=RLSettings)
_STORE.store(group="schema", name="parallel", node=ParallelSettings)
