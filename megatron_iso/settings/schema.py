"""The config's schema, read from the config tree itself: which dotted keys exist and which types their values take.

The known keys are the root config's keys plus, for every config group (a directory of ``conf/``), the
union of the keys of all its options (``model.*``: every key some ``conf/model/*.yaml`` sets). A key added to a YAML
file is known at once: nothing here lists keys by hand. A value's type is the union of the types the options give it
(an int everywhere: integers; a float somewhere: numbers; a bool: true or false; null in every option: any type, the
group's resolver checks it); :data:`TYPE_EXCEPTIONS` widens the few keys whose YAML default is narrower than what they
take. :data:`OPEN_NODES` are mappings passed through to another library; any key below them is accepted.

:func:`check_overrides` refuses an override naming an unknown key (with or without ``+``) before Hydra composes, with
the nearest known name; :func:`check_schema` refuses an unknown key or a value of the wrong type in a composed config.
Ranges and allowed values are the groups' resolvers' (``settings.model``, ``settings.rl``, ...), which run after.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megatron_iso.settings.fields import SettingsError

# Mappings whose keys belong to another library: data.chat_template_kwargs goes to the tokenizer's
# apply_chat_template as keyword arguments (e.g. {enable_thinking: false} for Qwen3), so any key is accepted there.
OPEN_NODES = ("data.chat_template_kwargs",)
# Keys that take more than their YAML default's type says (the resolver named in each comment checks the value).
TYPE_EXCEPTIONS: dict[str, frozenset[str]] = {
    "resume": frozenset({"bool", "str"}),  # true | false | auto (fields.resume_mode)
    "rl.recompute_old_logprobs": frozenset({"bool", "str"}),  # auto | true | false (rl.check_ppo)
    "data.chat_template": frozenset({"str", "bool"}),  # auto | true | false (data.resolve_data)
    "model.full_attention_interval": frozenset({"int", "list"}),  # every k-th layer, or per-layer types
    "dist_timeout_s": frozenset({"float"}),  # seconds; 600 in the YAML, 0.5 is fine
    # Null in every option, a path or a text when set.
    "out_dir": frozenset({"str"}),
    "model.init_from": frozenset({"str"}),
    "data.system_prompt": frozenset({"str"}),
    "logger.entity": frozenset({"str"}),
}
# Keys the settings read (with a default) that no YAML option lists. model.init_std stays out of the model YAMLs: the
# contract's semantic identity hashes every model key, so adding it there would move every digest.
EXTRA_KEYS: dict[str, frozenset[str]] = {"model.init_std": frozenset({"float"})}
_TYPE_WORDS = {
    "bool": "true or false",
    "int": "integers",
    "float": "numbers",
    "str": "a string",
    "list": "a list",
    "dict": "a mapping",
}
_SKIP_ROOT = ("defaults", "hydra")


def _kind(value: Any) -> str | None:
    """The schema's type of a YAML value; None for null and interpolations (they say nothing of the type)."""
    if value is None or (isinstance(value, str) and value.startswith("${")):
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, Mapping):
        return "dict"
    if isinstance(value, Sequence) and not isinstance(value, str):  # a list, or OmegaConf's ListConfig
        return "list"
    return "str"


def _leaves(node: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf below ``node``; a list, an empty mapping and an open node are leaves."""
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value and dotted not in OPEN_NODES:
            yield from _leaves(value, dotted + ".")
        else:
            yield dotted, value


@dataclass(frozen=True)
class Schema:
    """Known dotted keys, each with the types its value may take (empty: any) and whether null is seen."""

    types: Mapping[str, frozenset[str]]
    nullable: frozenset[str]  # keys some option sets to null
    groups: frozenset[str]  # the config groups (directories of the config tree)
    where: str  # the config tree, for messages

    @property
    def keys(self) -> list[str]:
        return sorted(self.types)

    def known(self, dotted: str) -> bool:
        if dotted in self.types:
            return True
        # Below an open node, or an inner node of known keys (rollout.parallel).
        return any(dotted.startswith(n + ".") for n in OPEN_NODES) or any(
            k.startswith(dotted + ".") for k in self.types
        )


def _read_yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return {k: v for k, v in data.items() if k not in _SKIP_ROOT} if isinstance(data, dict) else {}


@functools.cache
def _schema_of(conf: str) -> Schema:
    root = Path(conf)
    seen: dict[str, set[str]] = {}
    nulls: set[str] = set()

    def add(dotted: str, value: Any) -> None:
        kinds = seen.setdefault(dotted, set())
        if (kind := _kind(value)) is not None:
            kinds.add(kind)
        elif value is None:
            nulls.add(dotted)

    groups = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    for path in sorted(root.glob("*.yaml")):
        for dotted, value in _leaves(_read_yaml(path), ""):
            add(dotted, value)
    for group in sorted(groups):
        for option in sorted((root / group).glob("*.yaml")):
            for dotted, value in _leaves(_read_yaml(option), f"{group}."):
                add(dotted, value)
    types = {k: frozenset(TYPE_EXCEPTIONS.get(k, v)) for k, v in seen.items()} | EXTRA_KEYS
    from megatron_iso.settings.compose import SHIPPED_NAME, shipped_conf

    where = SHIPPED_NAME if root == shipped_conf() else str(root)
    return Schema(types, frozenset(nulls), frozenset(groups), where)


def schema() -> Schema:
    """The schema of the config tree in use (``megatron_iso.settings.compose.conf_dir``): its root configs (config.yaml,
    iso_bench.yaml) and every option of its groups."""
    from megatron_iso.settings.compose import conf_dir

    return _schema_of(str(conf_dir()))


def unknown_key_error(dotted: str, value: Any, s: Schema) -> SettingsError:
    """ "unknown key rl.lrr=0.1; did you mean rl.lr?": the nearest key of the same group (its last part compared,
    so the shared ``rl.`` does not make every key look alike), else the nearest key anywhere (``modle.x``)."""
    head, _, rest = dotted.partition(".")
    family = {k.partition(".")[2]: k for k in s.keys if k.partition(".")[0] == head} if rest else {}
    close = [family[m] for m in difflib.get_close_matches(rest, list(family), n=1, cutoff=0.6)]
    if not close and not family:
        close = difflib.get_close_matches(dotted, s.keys, n=1, cutoff=0.6)
    shown = "" if value is _NO_VALUE else f"={value!r}" if not isinstance(value, str) else f"={value}"
    where = f"{s.where}/{head}/*.yaml" if head in s.groups else f"{s.where}/config.yaml"
    hint = f"did you mean {close[0]}?" if close else f"the known keys are those of {where}"
    return SettingsError(f"unknown key {dotted}{shown}; {hint}")


_NO_VALUE = object()


def check_overrides(overrides: Sequence[str]) -> None:
    """Refuse a command-line override (``key=value``, ``+key=value``, ``++key=value``, ``~key``) whose key the
    schema does not know, before Hydra composes: Hydra's own refusal asks to append the key with ``+``, which it
    then accepts and nothing reads. Group choices (``model=tiny_moe``) and ``hydra.*`` are Hydra's to check."""
    s = schema()
    for text in overrides:
        key, eq, value = text.partition("=")
        key = key.lstrip("+~").strip()
        if not key or key.split(".", 1)[0] == "hydra" or key in s.groups or "/" in key or "@" in key:
            continue
        if not s.known(key):
            raise unknown_key_error(key, value if eq else _NO_VALUE, s)


def _type_error(dotted: str, value: Any, allowed: frozenset[str], nullable: bool) -> SettingsError:
    words = " or ".join(_TYPE_WORDS[k] for k in sorted(allowed) if not (k == "int" and "float" in allowed))
    return SettingsError(f"{dotted}={value!r} is not allowed; allowed values: {words}{' or null' if nullable else ''}")


def _fits(value: Any, allowed: frozenset[str]) -> bool:
    kind = _kind(value)
    if kind is None or not allowed:
        return True
    if kind == "int" and "float" in allowed:
        return True  # an integer is a number
    if kind in ("int", "float") and allowed == {"str"}:
        return True  # a name or path Hydra read as a number (model.name=123): str() of it is meant
    return kind in allowed


def check_keys(cfg: Mapping[str, Any]) -> None:
    """Every key of the plain config ``cfg`` is known (:func:`unknown_key_error` names the nearest known one)."""
    s = schema()
    for dotted, value in _leaves(cfg, ""):
        if dotted.split(".", 1)[0] != "hydra" and not s.known(dotted):
            raise unknown_key_error(dotted, value, s)


def check_types(cfg: Mapping[str, Any]) -> None:
    """Every value of the plain config ``cfg`` has one of its key's types. The resolvers check the keys they read
    first (their errors name the range too: "integers >= 1"); this pass catches the rest, e.g. a key a newer YAML
    option added and no resolver reads yet, which a raw cast would otherwise take (``bool('no')`` is True)."""
    s = schema()
    for dotted, value in _leaves(cfg, ""):
        allowed = s.types.get(dotted)
        if dotted.split(".", 1)[0] == "hydra" or not s.known(dotted):
            continue
        if allowed is None:
            if not isinstance(value, Mapping) and value is not None:  # an inner node (rollout.parallel) given a value
                raise _type_error(dotted, value, frozenset({"dict"}), nullable=False)
        elif not _fits(value, allowed):
            raise _type_error(dotted, value, allowed, nullable=dotted in s.nullable)


def check_schema(cfg: Mapping[str, Any]) -> None:
    """:func:`check_keys` then :func:`check_types`."""
    check_keys(cfg)
    check_types(cfg)
