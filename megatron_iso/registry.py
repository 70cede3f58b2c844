"""The op registry: every implementation of an op declares itself here.

A root module: ``ops/`` and ``parallel/`` register into it, ``contract/`` reads it, and it imports
nothing from the package, so the op layers never depend on the contract. An implementation is identified by ``impl_id@version`` and carries the constants
that can change a bit of its output (leaves, tiles, chunk size, accumulation
dtype). The contract builder reads the registry to write the ``composition``
section; the ops' dispatch points read it to pick the function to call. One
registry, so what runs is what the contract says runs.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

DEVICE_CLASSES = ("cpu", "cuda")


class Profile(str, Enum):
    """The two numerical policies. A ``str``: equal to, hashed and serialised as its value ("correctness",
    "performance"), so config values, canonical JSON and digests read the same as plain strings."""

    CORRECTNESS = "correctness"  # invariant ops: results independent of batch, layout and case
    PERFORMANCE = "performance"  # stock ops: the baseline the correctness profile is measured against

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


PROFILES = tuple(p.value for p in Profile)
# The executions the contract covers; every implementation says which it serves.
CASES = ("trainer_forward", "trainer_score", "prefill", "decode")


def float_bits(value: float) -> str:
    """A float as its IEEE-754 binary64 bit pattern, so canonical JSON never holds a decimal float."""
    return "f64:0x" + struct.pack(">d", float(value)).hex()


def _canonical_constant(name: str, value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return float_bits(value)
    if isinstance(value, (list, tuple)):
        return [_canonical_constant(name, v) for v in value]
    raise TypeError(
        f"constant '{name}' has unsupported type {type(value).__name__}; use int, str, bool, float or a list"
    )


@dataclass(frozen=True)
class OpImpl:
    """One registered implementation of an op."""

    op: str  # op family and member, e.g. "gemm", "rmsnorm", "attention", "logprob"
    impl_id: str  # e.g. "leaf_tree_gemm.reference"
    version: str
    device_class: str  # one of DEVICE_CLASSES
    profile: str  # one of PROFILES: correctness (invariant) or performance (native)
    fn: Callable[..., Any] = field(compare=False, repr=False)
    constants: Mapping[str, Any] = field(default_factory=dict)
    cases: tuple[str, ...] = CASES
    # For an entry whose rollout and trainer sides run different code: why they are equal.
    equivalence_note: str = ""
    # Runs this implementation on fixed seeded inputs and returns {case_or_name: output tensor};
    # the lockfile stores SHA-256 digests of those outputs (golden probes).
    probe: Callable[[], Mapping[str, Any]] | None = field(default=None, compare=False, repr=False)
    # Cases served by other code than ``fn`` (e.g. a decode kernel): case -> "impl_id@version". Such an
    # asymmetric entry must carry an ``equivalence_note``; the contract builder enforces it.
    case_impls: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device_class not in DEVICE_CLASSES:
            raise ValueError(f"OpImpl {self.impl_id}: device_class={self.device_class!r}, allowed {DEVICE_CLASSES}")
        if self.profile not in PROFILES:
            raise ValueError(f"OpImpl {self.impl_id}: profile={self.profile!r}, allowed {PROFILES}")
        bad = [c for c in self.cases if c not in CASES]
        if bad:
            raise ValueError(f"OpImpl {self.impl_id}: unknown cases {bad}, allowed {CASES}")
        for case, ref in self.case_impls.items():
            if case not in self.cases:
                raise ValueError(
                    f"OpImpl {self.impl_id}: case_impls names case {case!r}, which is not in cases {self.cases}"
                )
            if ref.count("@") != 1 or ref.startswith("@") or ref.endswith("@"):
                raise ValueError(f"OpImpl {self.impl_id}: case_impls[{case!r}]={ref!r}, expected 'impl_id@version'")

    @property
    def ref(self) -> str:
        return f"{self.impl_id}@{self.version}"

    def impl_for(self, case: str) -> str:
        """The ``impl_id@version`` that serves ``case`` (``ref`` unless ``case_impls`` overrides it)."""
        return self.case_impls.get(case, self.ref)

    def canonical(self) -> dict[str, Any]:
        """What the contract records: everything but the callable."""
        return {
            "impl": self.ref,
            "device_class": self.device_class,
            "constants": {k: _canonical_constant(k, v) for k, v in sorted(self.constants.items())},
            "cases": sorted(self.cases),
            "equivalence_note": self.equivalence_note,
        }


_REGISTRY: dict[tuple[str, str, str], OpImpl] = {}
# Runs an implementation on fixed seeded inputs: {output name: tensor}.
Probe = Callable[[], Mapping[str, Any]]
# The fields one device's entry may set for itself in ``register_per_device``.
DEVICE_FIELDS = ("constants", "case_impls", "equivalence_note")


def register(impl: OpImpl) -> OpImpl:
    """Add ``impl``; a second, different implementation for the same (op, device, profile) is an error, and so is a
    constant the contract cannot record (checked here, at import, not when a GPU run first builds its contract)."""
    impl.canonical()
    key = (impl.op, impl.device_class, impl.profile)
    old = _REGISTRY.get(key)
    if old is not None and old.ref != impl.ref:
        raise ValueError(
            f"op '{impl.op}' ({impl.device_class}, {impl.profile}) already served by {old.ref}, not {impl.ref}"
        )
    _REGISTRY[key] = impl
    return impl


def register_per_device(
    *,
    op: str,
    impl_id: str,
    version: str,
    profile: str,
    fn: Callable[..., Any],
    constants: Mapping[str, Any],
    probe_for: Callable[[str], Probe | None] | None = None,
    cases: tuple[str, ...] = CASES,
    equivalence_note: str = "",
    fields_for: Callable[[str], Mapping[str, Any]] | None = None,
) -> tuple[OpImpl, ...]:
    """Register one implementation, the same code and constants, for every device class: the stock
    (native) paths and the torch references run unchanged on CPU and CUDA. ``probe_for(device_class)``
    gives that device's probe (its inputs on that device), or None where the device has none.

    ``fields_for(device_class)``: what one device's entry says beyond the shared fields, as a mapping with
    keys among :data:`DEVICE_FIELDS` (``constants`` are added to the shared ones); e.g. the GDN rule on cuda,
    whose rollout cases another library serves where it is installed."""
    impls = []
    for device_class in DEVICE_CLASSES:
        own = dict(fields_for(device_class)) if fields_for is not None else {}
        unknown = sorted(set(own) - set(DEVICE_FIELDS))
        if unknown:
            raise ValueError(f"register_per_device {impl_id}: fields_for gave {unknown}; allowed keys {DEVICE_FIELDS}")
        impl = OpImpl(
            op=op,
            impl_id=impl_id,
            version=version,
            device_class=device_class,
            profile=profile,
            fn=fn,
            constants={**constants, **own.get("constants", {})},  # each entry owns its constants
            cases=cases,
            equivalence_note=own.get("equivalence_note", equivalence_note),
            probe=None if probe_for is None else probe_for(device_class),
            case_impls=dict(own.get("case_impls", {})),
        )
        impls.append(register(impl))
    return tuple(impls)


def lookup(op: str, device_class: str, profile: str) -> OpImpl:
    """The implementation serving ``op`` for a device class and profile."""
    try:
        return _REGISTRY[(op, device_class, profile)]
    except KeyError:
        have = sorted({k[0] for k in _REGISTRY})
        raise KeyError(
            f"no implementation of op '{op}' for device_class={device_class!r}, profile={str(profile)!r}; registered ops: {have}"
        ) from None


def registered(device_class: str | None = None, profile: str | None = None) -> list[OpImpl]:
    """All registered implementations, filtered, in a stable order."""
    out = [
        impl
        for (op, dev, prof), impl in _REGISTRY.items()
        if (device_class is None or dev == device_class) and (profile is None or prof == profile)
    ]
    return sorted(out, key=lambda i: (i.op, i.device_class, i.profile))


@contextlib.contextmanager
def swapped(impl: OpImpl) -> Iterator[OpImpl]:
    """Serve ``impl``'s (op, device class, profile) with ``impl`` for the body, then restore the
    incumbent (or remove the entry when there was none). For trying a candidate implementation
    (``iso-gate``) without registering it for good."""
    key = (impl.op, impl.device_class, impl.profile)
    old = _REGISTRY.get(key)
    _REGISTRY[key] = impl
    try:
        yield impl
    finally:
        if old is None:
            _REGISTRY.pop(key, None)
        else:
            _REGISTRY[key] = old
