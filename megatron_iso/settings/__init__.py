"""The one reading of the Hydra config: the composed DictConfig, validated once into typed settings.

:func:`resolve` turns the root config (``conf/``) into :class:`Settings`: typed groups (``model``, ``parallel``,
``rl``, ``rollout``, the run's ``seed`` / ``out_dir`` / ``resume``) and a resolved :class:`ProfileSettings`: the
device class from ``device: auto|cpu|cuda``, the GDN output form from ``profile.gdn_form: auto|scan|chunk`` and its
dot precision (the GDN op family says which forms exist where), the leaves the layers use. Errors name the field
and the allowed values. :func:`check_config` is the one validation of a config, :func:`resolve` plus every check
that reads only the config: ``iso-train`` (:func:`check_trainable`) and ``iso-contract`` (:func:`contract_for`)
both run it, so neither accepts a config the other refuses.

Layering: this package sits above ``ops`` and ``contract``: it may ask the op families (lazily) and fills the contract
builder's :class:`~megatron_iso.contract.build.ContractInputs`, which the builder reads; the groups live in modules
by concern (``profile``, ``model``, ``parallel``, ``rl``, ``task``, ``data``), the composition of the Hydra config
in ``compose``. Only this package and ``cli/`` touch OmegaConf objects: everything else gets :class:`Settings`.
:func:`contract_for` is every tool's one way from a config to its contract: it loads every registered implementation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from megatron_iso.contract.build import ContractInputs, ContractValidationError
from megatron_iso.contract.build import build_contract as _build_contract
from megatron_iso.contract.build import check_gpu_gemm_shapes as _check_gpu_gemm_shapes
from megatron_iso.contract.loader import load_op_implementations
from megatron_iso.contract.schema import Contract
from megatron_iso.errors import UserError
from megatron_iso.settings.compose import load_config_with_model, plain_config
from megatron_iso.settings.data import DataSettings, resolve_data
from megatron_iso.settings.fields import (
    LOGGERS,
    RESUME_MODES,
    WANDB_MODES,
    SettingsError,
    _group,
    _int,
    _positive,
    check_logger,
    check_out_dir,
    resume_mode,
)
from megatron_iso.settings.model import (
    HF_GDN_LAYOUTS,
    PARAMS_DTYPES,
    GDNSettings,
    ModelSettings,
    MoESettings,
    resolve_gdn,
    resolve_model,
    resolve_moe,
)
from megatron_iso.settings.parallel import (
    SHARDED_BY,
    ParallelSettings,
    check_shardable,
    cp_degrees,
    resolve_parallel,
    shard_degrees,
)
from megatron_iso.settings.profile import (
    DEVICES,
    ProfileSettings,
    check_gdn_choice_runs_here,
    check_profile_name,
    domain_degrees,
    resolve_device_class,
    resolve_gdn_form,
    resolve_profile,
    validate_profile,
)
from megatron_iso.settings.resources import (
    check_launch,
    check_memory,
    check_writable_dir,
    data_parallel,
    launch_world,
)
from megatron_iso.settings.rl import (
    LR_DECAY_STYLES,
    NONFINITE_POLICIES,
    RLSettings,
    RolloutSettings,
    check_backward_states,
    check_micro_batch_seqs,
    check_routing_replay,
    ppo_mini_batches,
    resolve_rl,
    resolve_rollout,
)
from megatron_iso.settings.schema import check_keys, check_overrides, check_schema, check_types
from megatron_iso.settings.shapes import check_size_types
from megatron_iso.settings.task import TaskSettings, check_task_files, resolve_task

__all__ = [
    "DEVICES",
    "HF_GDN_LAYOUTS",
    "LOGGERS",
    "LR_DECAY_STYLES",
    "NONFINITE_POLICIES",
    "PARAMS_DTYPES",
    "RESUME_MODES",
    "SHARDED_BY",
    "WANDB_MODES",
    "DataSettings",
    "GDNSettings",
    "MoESettings",
    "ModelSettings",
    "ParallelSettings",
    "ProfileSettings",
    "RLSettings",
    "RolloutSettings",
    "Settings",
    "SettingsError",
    "TaskSettings",
    "check_backward_states",
    "check_config",
    "check_gdn_choice_runs_here",
    "check_gpu_gemm_shapes",
    "check_logger",
    "check_micro_batch_seqs",
    "check_out_dir",
    "check_overrides",
    "check_pipeline",
    "check_profile_name",
    "check_runs_here",
    "check_schema",
    "check_shardable",
    "check_trainable",
    "config_world",
    "config_yaml",
    "contract_for",
    "contract_inputs",
    "domain_degrees",
    "gemm_block_k",
    "resolve",
    "resolve_data",
    "resolve_device_class",
    "resolve_gdn",
    "resolve_gdn_form",
    "resolve_model",
    "resolve_moe",
    "resolve_parallel",
    "resolve_profile",
    "resolve_rl",
    "resolve_rollout",
    "resolve_task",
    "resume_mode",
    "rollout_layout",
    "rollout_parallel",
    "settings_with_model",
    "shard_degrees",
    "validate_profile",
    "with_out_dir",
]

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
    data: DataSettings = field(default_factory=DataSettings)  # prompt files (task=dataset)
    task: TaskSettings | None = None
    seed: int | None = None
    out_dir: Path | None = None  # None: the run makes a new directory (rl.run_dir.default_run_dir)
    resume: str = "false"  # one of RESUME_MODES
    dist_timeout_s: float | None = None  # collectives' timeout (dist_timeout_s); None: torch's default
    # The config as resolved plain containers: what a run records of itself (config.yaml, the logger, the run
    # identity a resume must match). Nothing decides from it: the typed groups above are the reading.
    config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def device_class(self) -> str:
        return self.profile.device_class

    def require(self, name: str) -> Any:
        value = getattr(self, name)
        if value is None:
            raise ContractValidationError(f"config has no '{name}' group; compose the root config (conf/config.yaml)")
        return value


def _contract_part(c: Mapping[str, Any]) -> tuple[ProfileSettings, ContractInputs]:
    """The resolved profile and the contract builder's inputs of a plain config (the three groups, the device, the
    profile): what :func:`resolve` reads first."""
    model, profile, parallel = _group(c, "model"), _group(c, "profile"), _group(c, "parallel")
    resolved = resolve_profile(profile, c.get("device", "auto"))
    # The invariance domains' degrees Megatron can shard the model at (the rest are no claim: ContractInputs).
    shardable = {
        axis: shard_degrees(model, axis, domain_degrees(resolved.raw, axis))
        for axis in SHARDED_BY
        if resolved.raw.get(f"{axis}_domain") is not None
    }
    if resolved.raw.get("cp_domain") is not None:  # the CP degrees the model runs at (a hybrid: 1)
        shardable["cp"] = cp_degrees(model, domain_degrees(resolved.raw, "cp"))
    contract = dict(c.get("contract") or {})
    inputs = ContractInputs(resolved.device_class, resolved.raw, model, parallel, shardable, contract)
    return resolved, inputs


def check_config(cfg: DictConfig | Mapping[str, Any] | Settings) -> Settings:
    """The one validation of a config, :func:`resolve` and every check that reads nothing but the config: the
    profile against the model (``settings.profile.validate_profile``), the GDN choice against the device class,
    the pipeline's needs (:func:`check_pipeline`), routing replay against the model, the PPO mini-batch size
    against the step's prompts, an ``out_dir`` for ``resume``. ``iso-contract`` (through
    :func:`contract_for`) and ``iso-train`` (through :func:`check_trainable`) both call it before anything else,
    so a config one refuses the other refuses with the same error. Not here: what depends on the machine or the
    launch (a visible GPU, the world size: :func:`check_runs_here`, ``parallel.world``) and the GPU GEMM tiles
    (:func:`check_gpu_gemm_shapes`, a capability of the kernels that iso-train checks on CUDA only)."""
    settings = resolve(cfg)  # the profile against the model included (validate_profile, in resolve)
    check_gdn_choice_runs_here(settings.profile)
    check_pipeline(settings)
    check_routing_replay(settings.rl, settings.model.moe, settings.parallel.sp and settings.parallel.tp > 1)
    ppo_mini_batches(settings.rl, settings.task.prompts_per_step if settings.task is not None else None)
    check_contract_limits(settings.contract.contract, settings.model.max_position_embeddings)
    if settings.out_dir is None and settings.resume != "false":
        raise SettingsError(
            f"resume={settings.resume} needs the out_dir of the run to continue (without one, every run gets a new "
            "runs/<time>-<id>); set out_dir=..."
        )
    return settings


def contract_inputs(cfg: DictConfig | Mapping[str, Any] | Settings) -> ContractInputs:
    """What the contract builder reads, once the whole config passed :func:`check_config`: a raw config and its
    :class:`Settings` give the same inputs, hence the same digests (``iso-contract`` and ``iso-train``)."""
    return check_config(cfg).contract


def resolve(cfg: DictConfig | Mapping[str, Any] | Settings) -> Settings:
    """The one reading of ``cfg`` (a composed root config, or a mapping holding at least model, profile and
    parallel); a :class:`Settings` is returned as it is."""
    if isinstance(cfg, Settings):
        return cfg
    c = plain_config(cfg)
    check_keys(c)
    try:
        settings = _resolve_groups(c)
    except UserError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError):
        check_types(c)  # a value of the wrong type that a check below missed: named, not a traceback
        raise
    check_types(c)  # what no resolver reads (the resolvers' own errors come first: they name the range)
    return settings


def _resolve_groups(c: dict[str, Any]) -> Settings:
    resolved, inputs = _contract_part(c)
    # The profile's leaves against the model's sizes before the model's own shape rules: its error lists the
    # leaves this model allows.
    check_size_types(inputs.model)
    validate_profile(inputs.profile, inputs.model)
    rl = c.get("rl")
    rl_settings = resolve_rl(rl) if isinstance(rl, Mapping) else None
    if isinstance(c.get("logger"), Mapping):
        check_logger(c["logger"])
    rollout = c.get("rollout")
    model = resolve_model(inputs.model)
    return Settings(
        profile=resolved,
        model=model,
        parallel=resolve_parallel(inputs.parallel, inputs.model),
        contract=inputs,
        gdn_backward_states=rl_settings.gdn_backward_states if rl_settings else "keep",
        rl=rl_settings,
        rollout=resolve_rollout(rollout) if isinstance(rollout, Mapping) else None,
        data=resolve_data(c.get("data") if isinstance(c.get("data"), Mapping) else None),
        task=resolve_task(c["task"], model.vocab_size, model.max_position_embeddings)
        if isinstance(c.get("task"), Mapping)
        else None,
        seed=None if c.get("seed") is None else _int(c["seed"], "seed", -(2**63)),
        out_dir=check_out_dir(c.get("out_dir")),
        resume=resume_mode(c.get("resume", False)),
        dist_timeout_s=None if c.get("dist_timeout_s") is None else _positive(c["dist_timeout_s"], "dist_timeout_s"),
        config=c,
    )


def check_contract_limits(contract: Mapping[str, Any], max_positions: int) -> None:
    """``contract.max_batch`` and ``contract.max_seq_len`` (the shape limits the contract claims): positive
    integers, the sequence no longer than the model's positions (the contract builder's rule, checked with the rest
    of the config rather than when the trainer builds its contract)."""
    for key in ("max_batch", "max_seq_len"):
        value = contract.get(key)
        if key in contract and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ContractValidationError(
                f"contract.{key}={value!r} must be a positive integer; allowed values: integers >= 1"
            )
    seq = contract.get("max_seq_len")
    if isinstance(seq, int) and seq > max_positions:
        raise ContractValidationError(
            f"contract.max_seq_len={seq} exceeds model.max_position_embeddings={max_positions}; allowed values: "
            f"1 .. {max_positions}"
        )


def check_runs_here(settings: Settings, *, pipeline: bool = False) -> None:
    """What a run of the model needs beyond a valid config: a CUDA device for ``device=cuda``; one pipeline stage,
    unless ``pipeline`` (the RL trainer, :func:`check_pipeline`)."""
    if pipeline:
        check_pipeline(settings)
    elif settings.parallel.pp != 1:
        raise SettingsError(
            f"parallel.pp={settings.parallel.pp}: only the RL trainer (iso-train) runs pipeline parallelism; "
            "allowed values: [1]"
        )
    if settings.device_class == "cuda" and not torch.cuda.is_available():
        raise SettingsError("device=cuda but no CUDA device is visible; allowed values here: ['cpu', 'auto']")


def check_pipeline(settings: Settings) -> None:
    """``parallel.pp`` > 1 (the trainer's pipeline, megatron_iso.rl.pipeline): layers split evenly over the stages,
    untied embeddings (a tied LM head would live on two stages), no expert parallelism, no MoE load-balancing loss,
    no KL term (its frozen reference model is not pipelined) and no ``rl.save_hf_every``."""
    pp, model = settings.parallel.pp, settings.model
    if pp == 1:
        return
    why = []
    if model.num_layers % pp:
        why.append(f"model.num_layers={model.num_layers} split evenly into {pp} stages")
    if model.tie_word_embeddings:
        why.append("model.tie_word_embeddings=false")
    if settings.parallel.ep != 1:
        why.append(f"parallel.ep=1 (got {settings.parallel.ep})")
    if model.moe is not None and model.moe.aux_loss_coeff > 0:  # Megatron's schedule sets its scale per pass
        why.append(f"model.moe_aux_loss_coeff=0 (got {model.moe.aux_loss_coeff})")
    if settings.rl is not None and settings.rl.kl_coef > 0:
        why.append(f"rl.kl_coef=0 (got {settings.rl.kl_coef})")
    # The HF assembly names the whole model's layers on one rank (stage names: models.stages).
    if settings.rl is not None and getattr(settings.rl, "save_hf_every", 0):
        why.append(f"rl.save_hf_every=0 (got {settings.rl.save_hf_every}: the HF export assembles PP 1 ranks only)")
    if why:
        raise SettingsError(f"parallel.pp={pp} needs " + "; ".join(why) + "; or set parallel.pp=1")


def check_trainable(settings: Settings) -> None:
    """Before any world or model is built: the config's checks (:func:`check_config`, iso-contract's too), then
    what this machine and launch must have (:func:`check_runs_here`; the layout's processes and ``parallel.dp``;
    memory for the parameters, the KV cache and a micro-batch's logits: ``settings.resources``), the prompt files
    readable and the run directory writable."""
    check_config(settings)
    check_runs_here(settings, pipeline=True)
    # The launch (this process or torchrun's world) holds the layout, and parallel.dp agrees with it.
    p = settings.parallel
    world = launch_world()
    check_launch(p.tp, p.pp, p.ep, world)
    dp = data_parallel(p.tp, p.pp, p.dp, world)
    check_memory(settings, settings.task.prompts_per_step if settings.task is not None else None, dp)
    check_task_files(settings.task, settings.data.train_files, settings.data.val_files)
    check_writable_dir(settings.out_dir)


def config_world(cfg: DictConfig | Mapping[str, Any] | Settings) -> AbstractContextManager[int]:
    """``parallel.world.launched_world`` for a config, from its settings: ``parallel.tp/pp/ep``, ``seed`` and
    ``dist_timeout_s``. The one way a config-driven launch (iso-train, tools/bench_rl_step.py) opens its world."""
    from megatron_iso.parallel.world import launched_world

    s = resolve(cfg)
    p = s.parallel
    return launched_world(p.tp, p.pp, p.ep, s.require("seed"), timeout_s=s.dist_timeout_s, cp=p.cp)


def settings_with_model(model: Mapping[str, Any], overrides: Sequence[str] = ()) -> Settings:
    """The root config's settings with its ``model`` group given (a checkpoint's, or one derived from an HF
    config.json); ``model.KEY=VALUE`` overrides still apply on top of it, other overrides as usual."""
    return resolve(load_config_with_model(model, overrides))


def with_out_dir(settings: Settings, out_dir: Path) -> Settings:
    """``settings`` of a run given the directory ``out_dir`` (its recorded config too)."""
    return dataclasses.replace(settings, out_dir=out_dir, config={**settings.config, "out_dir": str(out_dir)})


def config_yaml(settings: Settings) -> str:
    """The resolved config as YAML (a run's ``config.yaml``)."""
    return OmegaConf.to_yaml(OmegaConf.create(dict(settings.config)))


# --- the rollout's layout ----------------------------------------------------------------------------------------

ROLLOUT_PARALLEL_KEYS = ("tp",)


def rollout_parallel(settings: Settings, world_size: int) -> dict[str, Any]:
    """The rollout's ``parallel`` block: the trainer's, with ``rollout.parallel``'s keys over it."""
    trainer = dict(settings.contract.parallel)
    given = dict(settings.require("rollout").parallel)
    unknown = sorted(set(given) - set(ROLLOUT_PARALLEL_KEYS))
    if unknown:
        raise SettingsError(f"rollout.parallel has unknown keys {unknown}; allowed keys: {list(ROLLOUT_PARALLEL_KEYS)}")
    tp = given.get("tp", trainer["tp"])
    allowed = [d for d in range(1, world_size + 1) if world_size % d == 0]
    if isinstance(tp, bool) or not isinstance(tp, int) or tp not in allowed:
        raise SettingsError(
            f"rollout.parallel.tp={tp!r} must divide the world size {world_size}; allowed values: {allowed}"
        )
    check_shardable(settings.contract.model, "tp", tp, "rollout.parallel.tp", candidates=allowed)
    # Megatron has no sequence parallelism without TP; the DP size is what the world leaves; the rollout is never
    # pipelined (a trainer's pipeline stages send it their weights) nor context parallel (the engine's prefill and
    # decode run whole sequences; a colocated decoder on CP ranks runs their DP rank's requests on each).
    sp = bool(trainer.get("sp", False)) and tp > 1
    return trainer | {"tp": tp, "pp": 1, "cp": 1, "sp": sp, "dp": world_size // tp}


def rollout_layout(settings: Settings, world_size: int) -> tuple[Settings, bool]:
    """The rollout side's settings (the trainer's with the parallel group of :func:`rollout_parallel`: its contract
    and model config) and whether that layout differs from the trainer's, so the decoder needs a model of its own
    (refused when the trainer's weights cannot be synced to it: expert parallelism)."""
    parallel = rollout_parallel(settings, world_size)
    p = settings.parallel
    separate = parallel["tp"] != p.tp or p.pp != 1
    if separate and p.ep != 1:
        raise SettingsError(
            f"a rollout layout of its own (rollout.parallel.tp={parallel['tp']}, parallel.tp={p.tp}, "
            f"parallel.pp={p.pp}) syncs the trainer's TP and pipeline shards only and needs parallel.ep=1 (got {p.ep})"
        )
    rollout = dataclasses.replace(
        settings,
        parallel=resolve_parallel(parallel, settings.contract.model),
        contract=dataclasses.replace(settings.contract, parallel=parallel),
        config={**settings.config, "parallel": parallel},
    )
    return rollout, separate


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
    return _build_contract(contract_inputs(cfg), impls)


def check_gpu_gemm_shapes(cfg: DictConfig | Mapping[str, Any] | Settings) -> None:
    """:func:`megatron_iso.contract.build.check_gpu_gemm_shapes` with the GEMM family's K tiles."""
    _check_gpu_gemm_shapes(contract_inputs(cfg), gemm_block_k())


# Structured-config schemas of the groups whose keys are fixed (validation of the YAML files against them:
# tests/test_settings.py). Stored under schema/ only: the conf/ groups' defaults and keys stay as they are.
_STORE = ConfigStore.instance()
_STORE.store(group="schema", name="rl", node=RLSettings)
_STORE.store(group="schema", name="parallel", node=ParallelSettings)
