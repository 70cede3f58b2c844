"""The one place that knows where the Hydra configs live and how to compose them outside ``@hydra.main``.

The configs live in the repository's top-level ``conf/``. setup.py installs that folder as the package
``megatron_iso.conf`` (a ``package_dir`` mapping), so a wheel or a non-editable install carries them at
``site-packages/megatron_iso/conf/``; a source checkout or an editable install (whose modules are the checkout's)
reads ``<checkout>/conf/`` beside ``megatron_iso/``. :func:`conf_dir` looks in those two places, in that order.

CLIs, tests and library code call :func:`load_config` with command-line style overrides
(``model=tiny_dense profile=performance parallel.tp=2``) and get the same DictConfig a
Hydra app would see, without Hydra taking over the process (no output dirs, no chdir). The composed config is
read once, into typed settings (:func:`megatron_iso.settings.resolve`, through :func:`plain_config`); only this
package and the command-line tools (``cli/``) handle OmegaConf objects.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

# What composing a config raises for a bad override or group (besides the settings' own UserErrors).
CONFIG_ERRORS: tuple[type[Exception], ...] = (HydraException, OmegaConfBaseException)
# Set to use a config tree other than the shipped one (a copy of conf/ with groups of one's own added).
CONF_ENV = "MEGATRON_ISO_CONF"
ROOT_CONFIG = "config"
_PACKAGE = Path(__file__).resolve().parent.parent  # megatron_iso/
# Where the shipped config tree is, first match wins: installed (setup.py's package_dir puts conf/ inside the
# package), then the source layout (a checkout, or an editable install, whose megatron_iso/ is the checkout's).
# Plain paths rather than importing megatron_iso.conf: conf/ holds no Python, and setuptools' editable finder
# only maps the top-level package.
SHIPPED_CONFS = (_PACKAGE / "conf", _PACKAGE.parent / "conf")
# How messages name the shipped tree: its place in the repository.
SHIPPED_NAME = "conf"


def shipped_conf() -> Path | None:
    """The config tree shipped with megatron_iso (installed or in the checkout), or None when neither is there."""
    return next((p for p in SHIPPED_CONFS if (p / f"{ROOT_CONFIG}.yaml").is_file()), None)


def conf_dir() -> Path:
    """Absolute path of the Hydra config directory: ``$MEGATRON_ISO_CONF`` when set, else the shipped ``conf/``."""
    override = os.environ.get(CONF_ENV)
    path = Path(override).resolve() if override else shipped_conf()
    if path is None or not (path / f"{ROOT_CONFIG}.yaml").is_file():
        where = f"${CONF_ENV}={override}" if override else "the installed package"
        looked = path if override else " nor ".join(map(str, SHIPPED_CONFS))
        raise FileNotFoundError(
            f"Hydra config directory {looked} ({where}) has no {ROOT_CONFIG}.yaml; "
            f"point ${CONF_ENV} at a copy of conf/, or reinstall megatron_iso"
        )
    return path


def load_config(overrides: Sequence[str] = (), config_name: str = ROOT_CONFIG) -> DictConfig:
    """Compose the root config with Hydra ``overrides`` and return it (interpolations left lazy). Typed, resolved
    settings: :func:`megatron_iso.settings.resolve` of it."""
    # Hydra keeps one process-global instance; a caller already inside @hydra.main owns it, so park
    # it, compose with ours, and put it back rather than failing with "already initialized".
    global_hydra = GlobalHydra.instance()
    parked = global_hydra.hydra if global_hydra.is_initialized() else None
    if parked is not None:
        global_hydra.clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), job_name="megatron_iso", version_base=None):
            return compose(config_name=config_name, overrides=list(overrides))
    finally:
        if parked is not None:
            global_hydra.clear()
            global_hydra.initialize(parked)


def plain_config(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` as plain containers, interpolations resolved (a mapping: its groups copied one level deep)."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in cfg.items()}


def config_from_plain(config: Mapping[str, Any]) -> DictConfig:
    """A plain config (a checkpoint's, a grid cell's) as the DictConfig Hydra would compose: the tools that pass
    a config on to Hydra-driven code (bench cells) build it here."""
    return OmegaConf.create(dict(config))


def replace_model(
    cfg: Mapping[str, Any],
    model: Mapping[str, Any],
    model_overrides: Sequence[str] = (),
    tokenizer: str | None = None,
    replaces_tokenizers: Sequence[Any] = (),
) -> DictConfig:
    """A copy of ``cfg`` whose ``model`` group is ``model`` with the ``model.KEY=VALUE`` ``model_overrides`` on top;
    with ``tokenizer``, a ``task.tokenizer`` among ``replaces_tokenizers`` (the defaults) set to it."""
    group = OmegaConf.create(dict(model))
    if model_overrides:
        group = OmegaConf.merge(group, OmegaConf.from_dotlist([o[len("model.") :] for o in model_overrides]))
    out = copy.deepcopy(cfg) if isinstance(cfg, DictConfig) else OmegaConf.create(plain_config(cfg))
    with open_dict(out):
        out.model = group
        if tokenizer is not None and "task" in out and out.task.get("tokenizer") in replaces_tokenizers:
            out.task.tokenizer = tokenizer
    return out


def load_config_with_model(model: Mapping[str, Any], overrides: Sequence[str] = ()) -> DictConfig:
    """The root config with ``model`` replaced by a given dict (e.g. derived from a checkpoint's HF
    config.json); ``model.KEY=VALUE`` overrides still apply on top of it, other overrides as usual."""
    keys = [o.split("=", 1)[0] for o in overrides]
    if any(k.lstrip("+~") == "model" for k in keys):
        raise ValueError("a model=... group override conflicts with a model taken from a checkpoint; drop it")
    if any(k.startswith("~model.") for k in keys):
        raise ValueError("~model.KEY deletions are not supported on a checkpoint's model; set model.KEY=VALUE")
    model_overrides = [
        o.lstrip("+") for o, k in zip(overrides, keys, strict=True) if k.lstrip("+").startswith("model.")
    ]
    cfg = load_config([o for o in overrides if o.lstrip("+") not in model_overrides])
    OmegaConf.set_struct(cfg, False)
    cfg.model = OmegaConf.create(dict(model))
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(model_overrides))
    OmegaConf.set_struct(cfg, True)
    return cfg
