"""The contract's versioned data model.

A :class:`Contract` has three sections, each hashed on its own (see ``docs/CONTRACT.md``):

- ``semantic``: what is computed: model, architecture, op vocabulary, cases (with shape limits);
- ``numerical_policy``: how it is computed, down to the bit: composition (impl@version, device
  class, pinned constants per op and case), profile constants, claims, runtime;
- ``deployment``: knobs the claims prove neutral (TP inside its invariant domain, DP, device name):
  logged, never compared.

``to_dict`` gives the canonical form (floats already bit patterns); ``from_dict`` reads it back
and checks the stored identities against the content, so a file whose body was edited without
re-hashing is rejected.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_iso.contract.canonical import check_canonical, sha256_of
from megatron_iso.errors import UserError

SCHEMA = "megatron_iso.contract/1"
SIDES = ("trainer", "rollout")
# Which side of the RL loop runs each case: asymmetry between the two is what the contract polices.
CASE_SIDES = {"trainer_forward": "trainer", "trainer_score": "trainer", "prefill": "rollout", "decode": "rollout"}
CLAIM_KINDS = ("invariant", "pinned", "neutral", "unclaimed")


class ContractFormatError(UserError, ValueError):
    """A serialized contract does not follow the schema, or its identities do not match its content."""


def _req(d: Mapping[str, Any], key: str, where: str) -> Any:
    if not isinstance(d, Mapping):
        raise ContractFormatError(f"{where}: expected an object, got {type(d).__name__}")
    if key not in d:
        raise ContractFormatError(f"{where}: missing field '{key}'")
    return d[key]


@dataclass(frozen=True)
class CaseSpec:
    """One execution the contract covers, with the shape limits the claims are made for."""

    name: str
    side: str  # trainer | rollout
    max_batch: int
    max_seq_len: int
    tokens_per_step: int | None = None  # decode: 1; full-sequence cases: None (whole sequence)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "side": self.side,
            "max_batch": self.max_batch,
            "max_seq_len": self.max_seq_len,
            "tokens_per_step": self.tokens_per_step,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "case") -> CaseSpec:
        return cls(
            name=_req(d, "name", where),
            side=_req(d, "side", where),
            max_batch=_req(d, "max_batch", where),
            max_seq_len=_req(d, "max_seq_len", where),
            tokens_per_step=_req(d, "tokens_per_step", where),
        )


@dataclass(frozen=True)
class CompositionEntry:
    """Which implementation serves one op in one case, with its pinned constants."""

    op: str
    case: str
    impl: str  # impl_id@version
    device_class: str
    constants: Mapping[str, Any] = field(default_factory=dict)  # canonical (floats as bit patterns)
    equivalence_note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "impl": self.impl,
            "device_class": self.device_class,
            "constants": dict(self.constants),
            "equivalence_note": self.equivalence_note,
        }


@dataclass(frozen=True)
class AxisClaim:
    """What the policy says about one layout axis (tp, ep, sp, pp, dp, batch, ...).

    invariant: results are bitwise equal for every value in ``domain`` (the value is deployment);
    pinned: only ``value`` is covered (the value is policy);
    neutral: the axis never meets the arithmetic of a row (e.g. data parallel replicas);
    unclaimed: results may depend on it (performance profile).
    """

    axis: str
    kind: str
    domain: Any = None
    value: Any = None
    tolerance: int | None = 0  # 0 = bitwise; None = nothing claimed

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "domain": self.domain, "value": self.value, "tolerance": self.tolerance}

    @classmethod
    def from_dict(cls, axis: str, d: Mapping[str, Any]) -> AxisClaim:
        where = f"numerical_policy.claims.axes.{axis}"
        kind = _req(d, "kind", where)
        if kind not in CLAIM_KINDS:
            raise ContractFormatError(f"{where}.kind={kind!r}, allowed {CLAIM_KINDS}")
        return cls(axis, kind, _req(d, "domain", where), _req(d, "value", where), _req(d, "tolerance", where))


@dataclass(frozen=True)
class InvalidationRule:
    """State that must be dropped when an event happens, e.g. prefix_cache flushed on weight_sync."""

    state: str
    event: str  # not "on": YAML 1.1 reads a bare `on` key as the boolean true
    action: str = "flush"

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "event": self.event, "action": self.action}


@dataclass(frozen=True)
class Claims:
    axes: tuple[AxisClaim, ...]
    # Which cases must agree with which, and how closely (tolerance 0 = bit for bit).
    parity: Mapping[str, Any]
    invalidation: tuple[InvalidationRule, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "axes": {c.axis: c.to_dict() for c in self.axes},
            "parity": dict(self.parity),
            "invalidation": [
                r.to_dict() for r in sorted(self.invalidation, key=lambda r: (r.state, r.event, r.action))
            ],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Claims:
        where = "numerical_policy.claims"
        axes = _req(d, "axes", where)
        rules = _req(d, "invalidation", where)
        return cls(
            axes=tuple(AxisClaim.from_dict(a, axes[a]) for a in sorted(axes)),
            parity=dict(_req(d, "parity", where)),
            invalidation=tuple(
                InvalidationRule(_req(r, "state", where), _req(r, "event", where), _req(r, "action", where))
                for r in rules
            ),
        )

    def axis(self, name: str) -> AxisClaim:
        for c in self.axes:
            if c.axis == name:
                return c
        raise KeyError(f"no claim for axis '{name}'; claimed axes: {[c.axis for c in self.axes]}")


@dataclass(frozen=True)
class Semantic:
    model: Mapping[str, Any]  # name, family
    architecture: Mapping[str, Any]  # every other model hyperparameter, canonical
    op_vocabulary: tuple[str, ...]
    cases: tuple[CaseSpec, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "model": dict(self.model),
            "architecture": dict(self.architecture),
            "op_vocabulary": sorted(self.op_vocabulary),
            "cases": {c.name: c.to_dict() for c in self.cases},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Semantic:
        cases = _req(d, "cases", "semantic")
        return cls(
            model=dict(_req(d, "model", "semantic")),
            architecture=dict(_req(d, "architecture", "semantic")),
            op_vocabulary=tuple(_req(d, "op_vocabulary", "semantic")),
            cases=tuple(CaseSpec.from_dict(cases[n], f"semantic.cases.{n}") for n in sorted(cases)),
        )


@dataclass(frozen=True)
class NumericalPolicy:
    device_class: str
    profile: str
    constants: Mapping[str, Any]  # profile-level pinned constants (leaves, kv block, gdn chunk, ...)
    composition: tuple[CompositionEntry, ...]
    claims: Claims
    runtime: Mapping[str, Any]  # library versions whose kernels can change a bit

    def to_dict(self) -> dict[str, Any]:
        comp: dict[str, dict[str, Any]] = {}
        for e in self.composition:
            comp.setdefault(e.op, {})[e.case] = e.to_dict()
        return {
            "schema": SCHEMA,
            "device_class": self.device_class,
            "profile": self.profile,
            "constants": dict(self.constants),
            "composition": comp,
            "claims": self.claims.to_dict(),
            "runtime": dict(self.runtime),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NumericalPolicy:
        w = "numerical_policy"
        comp = _req(d, "composition", w)
        entries = []
        for op in sorted(comp):
            for case in sorted(comp[op]):
                e = comp[op][case]
                where = f"{w}.composition.{op}.{case}"
                entries.append(
                    CompositionEntry(
                        op,
                        case,
                        _req(e, "impl", where),
                        _req(e, "device_class", where),
                        dict(_req(e, "constants", where)),
                        _req(e, "equivalence_note", where),
                    )
                )
        return cls(
            device_class=_req(d, "device_class", w),
            profile=_req(d, "profile", w),
            constants=dict(_req(d, "constants", w)),
            composition=tuple(entries),
            claims=Claims.from_dict(_req(d, "claims", w)),
            runtime=dict(_req(d, "runtime", w)),
        )

    def entry(self, op: str, case: str) -> CompositionEntry:
        for e in self.composition:
            if e.op == op and e.case == case:
                return e
        raise KeyError(f"composition has no entry for op '{op}' in case '{case}'")


@dataclass(frozen=True)
class Deployment:
    parallel: Mapping[str, Any]  # the actual layout (tp, ep, sp, pp, dp, ...)
    device_name: str
    software: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "parallel": dict(self.parallel),
            "device_name": self.device_name,
            "software": dict(self.software),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Deployment:
        return cls(
            parallel=dict(_req(d, "parallel", "deployment")),
            device_name=_req(d, "device_name", "deployment"),
            software=dict(_req(d, "software", "deployment")),
        )


@dataclass(frozen=True)
class Identities:
    semantic: str
    numerical_policy: str
    deployment: str

    def to_dict(self) -> dict[str, str]:
        return {"semantic": self.semantic, "numerical_policy": self.numerical_policy, "deployment": self.deployment}


SECTIONS = ("semantic", "numerical_policy", "deployment")


@dataclass(frozen=True)
class Contract:
    semantic: Semantic
    numerical_policy: NumericalPolicy
    deployment: Deployment

    @property
    def identities(self) -> Identities:
        d = self.sections()
        return Identities(**{name: sha256_of(d[name]) for name in SECTIONS})

    def sections(self) -> dict[str, dict[str, Any]]:
        """The three hashed sections in canonical form."""
        return {
            "semantic": self.semantic.to_dict(),
            "numerical_policy": self.numerical_policy.to_dict(),
            "deployment": self.deployment.to_dict(),
        }

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": SCHEMA, **self.sections()}
        out["identities"] = self.identities.to_dict()
        check_canonical(out)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "contract") -> Contract:
        """Read a serialized contract; reject unknown schemas and identities that do not match the content."""
        try:
            schema = _req(d, "schema", source)
            if schema != SCHEMA:
                raise ContractFormatError(f"{source}: schema {schema!r} is not supported (this build reads {SCHEMA!r})")
            contract = cls(
                semantic=Semantic.from_dict(_req(d, "semantic", source)),
                numerical_policy=NumericalPolicy.from_dict(_req(d, "numerical_policy", source)),
                deployment=Deployment.from_dict(_req(d, "deployment", source)),
            )
            stored = _req(d, "identities", source)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ContractFormatError(f"{source}: malformed contract ({type(exc).__name__}: {exc})") from exc
        # Re-serializing must give back exactly what was stored, else the body was edited or written
        # by a different schema: either way its identities cannot be trusted.
        for name, section in contract.sections().items():
            if section != d[name]:
                first = _first_diff(section, d[name])
                raise ContractFormatError(f"{source}: section '{name}' is not in canonical form (at {first})")
        ids = contract.identities.to_dict()
        for name in SECTIONS:
            if stored.get(name) != ids[name]:
                raise ContractFormatError(
                    f"{source}: identities.{name}={stored.get(name)!r} does not match the content (sha256 {ids[name]}); "
                    "the file was edited or corrupted after it was written"
                )
        return contract


def _first_diff(a: Any, b: Any) -> str:
    from megatron_iso.contract.canonical import diff_paths

    diffs = diff_paths(a, b)
    return diffs[0][0] if diffs else "?"
