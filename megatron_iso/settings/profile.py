"""The ``profile`` group and ``device``, typed and checked: the profile's name, its leaves and invariance domains
against the model (:func:`validate_profile`), the device class (:func:`resolve_device_class`) and the GDN form the
op family resolves for it. The contract builder reads the result (``ContractInputs.profile``) and checks nothing of
it again."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_iso.contract.build import ContractValidationError, row_parallel_ks
from megatron_iso.registry import DEVICE_CLASSES, PROFILES, Profile
from megatron_iso.settings.fields import SettingsError, _get, _int

DEVICES = (*DEVICE_CLASSES, "auto")


def resolve_device_class(device: str) -> str:
    """``cpu``/``cuda`` as given; ``auto`` = cuda when a GPU is visible. Anything else is an error."""
    if device not in DEVICES:
        raise ContractValidationError(f"device={device!r} is not allowed; allowed values: {list(DEVICES)}")
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _is_pow2(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and (n & (n - 1)) == 0


def _pow2_divisors(ks: Mapping[str, int]) -> list[int]:
    out, g = [], 1
    while all(k % g == 0 for k in ks.values()) and g <= 1024:
        out.append(g)
        g *= 2
    return out


def check_profile_name(name: Any) -> Profile:
    """``profile.name`` as a :class:`Profile`; anything else is an error naming the field and the allowed values."""
    if name not in PROFILES:
        raise ContractValidationError(f"profile.name={name!r} is not allowed; allowed values: {list(PROFILES)}")
    return Profile(name)


def domain_degrees(profile: Mapping[str, Any], axis: str) -> list[int]:
    """``profile.<axis>_domain`` (tp, ep) checked: a list (null or absent: empty) of parallel degrees, each a
    positive integer; the error names the field and the entry."""
    field_name = f"profile.{axis}_domain"
    domain = profile.get(f"{axis}_domain")
    if domain is None:
        return []
    if not isinstance(domain, Sequence) or isinstance(domain, str):
        raise ContractValidationError(
            f"{field_name}={domain!r} is not allowed; allowed values: a list of positive integers"
        )
    for degree in domain:
        if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
            raise ContractValidationError(
                f"{field_name} contains {degree!r}; {axis.upper()} degrees are positive integers"
            )
    return list(domain)


def validate_profile(profile: Mapping[str, Any], model: Mapping[str, Any]) -> None:
    """The profile's leaves and domains against the model (each error names the field and the allowed values)."""
    check_profile_name(profile.get("name"))
    leaves = profile.get("leaves")
    if not _is_pow2(leaves):
        raise ContractValidationError(f"profile.leaves={leaves!r} must be a power of two (1, 2, 4, 8, 16, ...)")
    for tp in domain_degrees(profile, "tp"):
        if tp > leaves:
            raise ContractValidationError(
                f"profile.tp_domain contains {tp} > profile.leaves={leaves}: a rank must own at least one leaf; "
                f"raise profile.leaves to >= {tp} or drop {tp} from tp_domain"
            )
        if leaves % tp:
            raise ContractValidationError(
                f"profile.tp_domain contains {tp}, which does not divide profile.leaves={leaves}; "
                "each rank must own a whole subtree"
            )
    domain_degrees(profile, "ep")  # experts live whole on one EP rank: no leaf condition
    expert_leaves = profile.get("expert_leaves", 1)
    moe_ffn = model.get("moe_ffn_hidden_size")
    if not _is_pow2(expert_leaves):
        raise ContractValidationError(f"profile.expert_leaves={expert_leaves!r} must be a power of two (1, 2, 4, ...)")
    if isinstance(moe_ffn, int) and model.get("num_experts") and moe_ffn % expert_leaves:
        raise ContractValidationError(
            f"profile.expert_leaves={expert_leaves} does not divide model.moe_ffn_hidden_size={moe_ffn}"
        )
    for field_name, k in row_parallel_ks(model).items():
        if k % leaves:
            raise ContractValidationError(
                f"profile.leaves={leaves} does not divide {field_name}={k}; every row-parallel contraction is cut "
                f"into equal leaves (allowed leaves for this model: {_pow2_divisors(row_parallel_ks(model))})"
            )


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


def _leaves(profile: Mapping[str, Any], key: str, default: int) -> int:
    """``profile.<key>`` as an int; the power-of-two rule and the model's sizes are the contract's
    ``validate_profile`` (run by ``check_config``), whose error says which powers the model allows."""
    value = _get(profile, key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SettingsError(f"profile.{key}={value!r} is not allowed; allowed values: powers of two (1, 2, 4, 8, ...)")
    return value


def resolve_profile(profile: Mapping[str, Any], device: Any) -> ProfileSettings:
    """``profile`` and ``device`` resolved (order of checks: device, profile.name, the GDN choice)."""
    device_class = resolve_device_class(device)
    name = check_profile_name(profile.get("name"))
    form, precision = resolve_gdn_form(profile, device_class)
    chunk = _int(_get(profile, "gdn_chunk", 64), "profile.gdn_chunk", 1)
    # 0 (the performance profile's): the attention's default block of 64 keys.
    kv_block = _int(_get(profile, "attention_kv_block", 64), "profile.attention_kv_block", 0) or 64
    bitwise = name is Profile.CORRECTNESS
    raw = {**profile, "gdn_form": form} if "gdn_form" in profile else dict(profile)
    return ProfileSettings(
        name=name,
        device_class=device_class,
        leaves=_leaves(profile, "leaves", 8) if bitwise else 1,
        expert_leaves=_leaves(profile, "expert_leaves", 1) if bitwise else 1,
        attention_kv_block=kv_block,
        gdn_chunk=chunk,
        gdn_form=form,
        gdn_dot_precision=precision,
        raw=raw,
    )
