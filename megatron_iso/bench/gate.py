"""The kernel acceptance gate: a candidate op implementation is accepted only if it is faster than
the incumbent AND the numbers do not move (or the change is declared a new numerical policy).

The incumbent is the registry entry serving (op, device class, profile) of the config. The
candidate is one of

- ``package.module:function``: a drop-in function with the incumbent's signature;
- ``package.module:NAME`` where NAME is an :class:`~megatron_iso.registry.OpImpl`
  (its own identity and probe);
- ``impl_id@version``: a registered entry of the same op (another device class or profile).

Checks, in one process:

1. speed: both run on the same inputs (per-op defaults in :data:`DEFAULT_INPUTS`, or
   ``inputs=module:function`` returning ``(args, kwargs)``), alternating, ``warmup`` untimed then
   ``runs`` timed calls each; ``speedup = median(incumbent) / median(candidate)`` must reach
   ``min_speedup``;
2. numbers: with the candidate swapped in (registry entry replaced; every attribute that is the
   incumbent function, in modules under ``megatron_iso`` and in the incumbent's own and its
   probe's module, rebound to the candidate, so dispatch points and probes call it) the lockfile
   verification must pass, and the candidate's outputs on the benchmark inputs must equal the
   incumbent's bit for bit (this also covers probes that do not go through the swapped function).
   Without ``lock`` a baseline lock of the incumbent is made
   first. With ``new_policy`` a numerical change is accepted as a NEW policy: the candidate's own
   identity enters the contract and the new ``numerical_policy`` digest is reported.

Outcomes (``GateResult.exit_code``, the exit code of ``iso-gate``): :data:`EXIT_PASS`; :data:`EXIT_NUMERICS`
when the numbers moved (it wins over speed: it does not depend on timing noise); :data:`EXIT_NOT_FASTER`.
Failures: :class:`GateInputError` (a usage error), :class:`CandidateError` (the candidate, or the ``inputs``
function, raised: the candidate's own bug, kept apart from the gate's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType
from typing import Any

import torch

from megatron_iso.errors import UserError
from megatron_iso.registry import OpImpl

# iso-gate's exit codes. 0, 1 and 2 follow megatron_iso.cli.exit_codes (yes / no / usage error); 3 (NaN stop)
# and 4 (internal failure) keep their shared meaning; 5 and 6 are the gate's own.
EXIT_PASS = 0  # faster and the numbers hold (or a declared new policy)
EXIT_NOT_FASTER = 1  # the numbers hold, the speedup does not reach min_speedup
EXIT_BAD_INPUT = 2  # a usage error: bad option, unknown op or candidate, unreadable lock (GateInputError)
EXIT_NUMERICS = 5  # the numbers moved: lock mismatch or benchmark outputs differ (an undeclared policy change)
EXIT_CANDIDATE_FAILED = 6  # the candidate (or the inputs function) raised: its traceback, not a gate bug
EXIT_LOCK_MISMATCH = EXIT_NUMERICS  # the name before the codes were renumbered


class GateInputError(UserError, ValueError):
    """The gate cannot run as asked (unknown op or candidate, bad inputs, unreadable lock)."""


class CandidateError(Exception):
    """The candidate implementation raised while the gate called it; ``__cause__`` is its exception.

    Not a :class:`UserError` (its traceback matters to whoever wrote the candidate) and not an internal
    failure of the gate either."""


def _code_of(fn: Any) -> CodeType | None:
    """The code object a call of ``fn`` runs (through wrappers, partials and bound methods); None for a builtin."""
    fn = inspect.unwrap(fn)
    while isinstance(fn, functools.partial):
        fn = inspect.unwrap(fn.func)
    return getattr(getattr(fn, "__func__", fn), "__code__", None)


def _codes_in(exc: BaseException) -> list[CodeType]:
    """The code of every frame in the tracebacks of ``exc`` and the exceptions it was raised from (a probe
    failure re-raised by the lockfile check carries the candidate's frames in its cause)."""
    codes: list[CodeType] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        tb = cur.__traceback__
        while tb is not None:
            codes.append(tb.tb_frame.f_code)
            tb = tb.tb_next
        cur = cur.__cause__ or cur.__context__
    return codes


@contextlib.contextmanager
def candidate_failures(fn: Callable[..., Any], what: str, *, direct: bool = False) -> Iterator[None]:
    """Exceptions raised inside ``fn`` (user code: the candidate, the inputs function) become
    :class:`CandidateError` naming ``what``. ``direct``: the block calls only ``fn``, so anything it raises is
    ``fn``'s; otherwise the traceback must pass through ``fn``'s code (a gate bug beside a call of ``fn`` stays a
    gate bug)."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        code = _code_of(fn)
        if direct or (code is not None and code in _codes_in(exc)):
            raise CandidateError(f"{what} raised {type(exc).__name__}: {exc}") from exc
        raise


def _gemm_inputs() -> tuple[tuple[Any, ...], dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(64, 256, generator=g), torch.randn(256, 256, generator=g) / 16, 8), {}


def _rmsnorm_inputs() -> tuple[tuple[Any, ...], dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(64, 256, generator=g), 1 + torch.randn(256, generator=g) / 8, 1e-6), {}


def _swiglu_inputs() -> tuple[tuple[Any, ...], dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(64, 512, generator=g), torch.randn(64, 512, generator=g)), {}


# Benchmark inputs per op: () -> (args, kwargs) for the registry entry's ``fn``.
DEFAULT_INPUTS: dict[str, Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]] = {
    "gemm": _gemm_inputs,
    "rmsnorm": _rmsnorm_inputs,
    "swiglu": _swiglu_inputs,
}


@dataclass
class Candidate:
    label: str
    fn: Callable[..., Any]
    impl: OpImpl | None = None  # its own identity (and maybe probe), when it came as an OpImpl


@dataclass
class GateResult:
    op: str
    incumbent: str
    candidate: str
    incumbent_s: float
    candidate_s: float
    speedup: float
    min_speedup: float
    lock_lines: list[str] = field(default_factory=list)
    output_equal: bool = True
    new_policy: bool = False
    old_policy_digest: str = ""
    new_policy_digest: str = ""

    @property
    def faster(self) -> bool:
        return self.speedup >= self.min_speedup

    @property
    def numerics_ok(self) -> bool:
        return self.new_policy or (not self.lock_lines and self.output_equal)

    @property
    def exit_code(self) -> int:
        if not self.numerics_ok:
            return EXIT_NUMERICS
        return EXIT_PASS if self.faster else EXIT_NOT_FASTER

    def lines(self) -> list[str]:
        out = [
            f"op {self.op}: incumbent {self.incumbent}, candidate {self.candidate}",
            f"speed: incumbent {self.incumbent_s * 1e3:.3f} ms, candidate {self.candidate_s * 1e3:.3f} ms (medians); "
            f"speedup {self.speedup:.3f}x, required {self.min_speedup:.3f}x -> {'ok' if self.faster else 'NOT FASTER'}",
        ]
        out.append(
            "benchmark outputs: bitwise identical" if self.output_equal else "benchmark outputs: DIFFER from incumbent"
        )
        if self.lock_lines:
            out += [f"lock: {line}" for line in self.lock_lines]
        else:
            out.append("lock: contract and probe digests match")
        if self.new_policy:
            out.append(f"declared new numerical policy: {self.old_policy_digest} -> {self.new_policy_digest}")
        verdict = {EXIT_PASS: "PASS", EXIT_NOT_FASTER: "FAIL (not faster)", EXIT_NUMERICS: "FAIL (numerics)"}
        out.append(f"gate: {verdict[self.exit_code]}")
        return out


def _import_attr(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        raise GateInputError(f"cannot import {module!r} (from {spec!r}): {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise GateInputError(f"{module!r} has no attribute {attr!r} (from {spec!r})")
        obj = getattr(obj, part)
    return obj


def resolve_candidate(spec: str, op: str) -> Candidate:
    """``module:function``, ``module:OPIMPL`` or ``impl_id@version`` (see the module doc)."""
    from megatron_iso import registry

    if ":" in spec:
        obj = _import_attr(spec)
        if isinstance(obj, OpImpl):
            if obj.op != op:
                raise GateInputError(f"candidate {spec!r} implements op {obj.op!r}, not {op!r}")
            return Candidate(obj.ref, obj.fn, obj)
        if not callable(obj):
            raise GateInputError(f"candidate {spec!r} is a {type(obj).__name__}, expected a function or an OpImpl")
        return Candidate(spec, obj)
    if spec.count("@") == 1:
        found = [i for i in registry.registered() if i.op == op and i.ref == spec]
        if not found:
            have = sorted({i.ref for i in registry.registered() if i.op == op})
            raise GateInputError(f"no registry entry {spec!r} for op {op!r}; registered: {have}")
        return Candidate(spec, found[0].fn, found[0])
    raise GateInputError(f"candidate={spec!r}: expected 'package.module:function' or 'impl_id@version'")


def bench_inputs(op: str, spec: str | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if spec:
        make = _import_attr(spec)
        if not callable(make):
            raise GateInputError(f"inputs={spec!r} is a {type(make).__name__}, expected a function")
        with candidate_failures(make, f"inputs={spec!r}", direct=True):
            made = make()
    elif op in DEFAULT_INPUTS:
        made = DEFAULT_INPUTS[op]()
    else:
        raise GateInputError(
            f"no default benchmark inputs for op {op!r} (defaults: {sorted(DEFAULT_INPUTS)}); "
            "pass inputs=module:function returning (args, kwargs)"
        )
    try:
        args, kwargs = made
        return tuple(args), dict(kwargs)
    except (TypeError, ValueError):
        raise GateInputError(f"inputs={spec!r} returned {type(made).__name__}, expected (args, kwargs)") from None


def time_pair(
    a: Callable[..., Any], b: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], runs: int, warmup: int
) -> tuple[float, float]:
    """Median seconds of ``a`` and ``b``; calls alternate so machine load hits both alike."""
    ta, tb = [], []
    sync = torch.cuda.synchronize if any(isinstance(x, torch.Tensor) and x.is_cuda for x in args) else (lambda: None)
    with torch.no_grad():
        for i in range(warmup + runs):
            for fn, acc in ((a, ta), (b, tb)):
                sync()
                t0 = time.perf_counter()
                fn(*args, **kwargs)
                sync()
                if i >= warmup:
                    acc.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def _flat(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, tuple | list):
        return [t for o in out for t in _flat(o)]
    if isinstance(out, Mapping):
        return [t for k in sorted(out) for t in _flat(out[k])]
    return []


def bitwise_equal(a: Any, b: Any) -> bool:
    fa, fb = _flat(a), _flat(b)
    return len(fa) == len(fb) and all(
        x.shape == y.shape
        and x.dtype == y.dtype
        and torch.equal(x.detach().contiguous().view(torch.uint8), y.detach().contiguous().view(torch.uint8))
        for x, y in zip(fa, fb, strict=True)
    )


@contextlib.contextmanager
def swapped_in(incumbent: OpImpl, cand: Candidate, *, new_identity: OpImpl | None) -> Iterator[OpImpl]:
    """The candidate serves the op: registry entry replaced, ``megatron_iso`` module attributes that are
    the incumbent function rebound. Identity: the incumbent's (a drop-in) unless ``new_identity``."""
    from megatron_iso.registry import swapped

    base = new_identity or incumbent
    probe = cand.impl.probe if cand.impl is not None and cand.impl.probe is not None else incumbent.probe
    entry = dataclasses.replace(
        base,
        fn=cand.fn,
        probe=probe,
        op=incumbent.op,
        device_class=incumbent.device_class,
        profile=incumbent.profile,
    )
    # Where the incumbent is looked up: the package's dispatch points, its own module, its probe's
    # module. Not everywhere: a candidate module that wraps the incumbent must keep calling it.
    probe_fn = getattr(incumbent.probe, "func", incumbent.probe)  # through a functools.partial
    homes = {incumbent.fn.__module__, getattr(probe_fn, "__module__", None)}
    patched: list[tuple[Any, str]] = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name.startswith("megatron_iso.") or name in homes):
            continue
        for attr, value in list(vars(module).items()):
            if value is incumbent.fn:
                patched.append((module, attr))
    for module, attr in patched:
        setattr(module, attr, cand.fn)
    try:
        with swapped(entry):
            yield entry
    finally:
        for module, attr in patched:
            setattr(module, attr, incumbent.fn)


def check_candidate_id(candidate_id: str | None) -> None:
    if candidate_id is not None and (
        candidate_id.count("@") != 1 or candidate_id.startswith("@") or candidate_id.endswith("@")
    ):
        raise GateInputError(f"candidate_id={candidate_id!r} is not allowed; allowed values: 'impl_id@version'")


def check_numbers(runs: Any, warmup: Any, min_speedup: Any) -> None:
    """``runs`` an int >= 1, ``warmup`` an int >= 0, ``min_speedup`` a finite number > 0."""
    for name, value, low in (("runs", runs, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise GateInputError(f"{name}={value!r} is not allowed; allowed values: integers >= {low}")
    if isinstance(min_speedup, bool) or not isinstance(min_speedup, int | float) or not 0 < min_speedup < math.inf:
        raise GateInputError(f"min_speedup={min_speedup!r} is not allowed; allowed values: finite numbers > 0")


def _new_identity(incumbent: OpImpl, cand: Candidate, candidate_id: str | None) -> OpImpl:
    if candidate_id:
        check_candidate_id(candidate_id)
        impl_id, version = candidate_id.split("@")
        base = cand.impl or incumbent
        return dataclasses.replace(base, impl_id=impl_id, version=version, case_impls={})
    if cand.impl is not None:
        return cand.impl
    fn = cand.fn
    return dataclasses.replace(incumbent, impl_id=f"{fn.__module__}.{fn.__qualname__}", version="1", case_impls={})


def run_gate(
    op: str,
    candidate: str,
    *,
    overrides: Sequence[str] = (),
    lock: str | None = None,
    new_policy: bool = False,
    candidate_id: str | None = None,
    write_lock_to: str | None = None,
    min_speedup: float = 1.05,
    runs: int = 15,
    warmup: int = 3,
    inputs: str | None = None,
    ops_packages: Sequence[str] | None = None,
) -> GateResult:
    """Run both checks (see the module doc); raises :class:`GateInputError` on bad input (before anything is
    timed or written) and :class:`CandidateError` when the candidate raises. ``ops_packages``: the
    implementation packages to load instead of the project's own."""
    from megatron_iso.contract import load_op_implementations, read_lock, verify_lock, write_lock
    from megatron_iso.registry import lookup
    from megatron_iso.settings import contract_for, resolve_device_class
    from megatron_iso.settings.compose import load_config

    check_numbers(runs, warmup, min_speedup)
    check_candidate_id(candidate_id)
    if write_lock_to is not None and not new_policy:
        raise GateInputError(
            "write_lock_to (--write-lock) writes a new policy's lock; it needs new_policy (--new-policy)"
        )
    if write_lock_to is not None and not Path(write_lock_to).resolve().parent.is_dir():
        raise GateInputError(f"write_lock_to={write_lock_to!r}: directory {Path(write_lock_to).parent} does not exist")
    if lock is not None:
        read_lock(lock)  # LockfileError (bad input) before anything runs
    # The incumbent is looked up in the registry: fill it first (the named packages, or the project's own).
    if ops_packages:
        load_op_implementations(packages=ops_packages)
    else:
        load_op_implementations()
    cfg = load_config(list(overrides))

    def build_contract(cfg: Any) -> Any:
        return contract_for(cfg, load_implementations=not ops_packages)

    device = resolve_device_class(str(cfg.device))
    try:
        incumbent = lookup(op, device, str(cfg.profile.name))
    except KeyError as exc:
        raise GateInputError(str(exc.args[0])) from None
    cand = resolve_candidate(candidate, op)
    what = f"candidate {cand.label!r}"
    args, kwargs = bench_inputs(op, inputs)
    with torch.no_grad():
        try:
            ref_out = incumbent.fn(*args, **kwargs)
        except Exception as exc:
            if inputs is None:
                raise  # the project's own inputs for its own op: a bug
            raise GateInputError(
                f"the incumbent {incumbent.ref} raised {type(exc).__name__} on inputs={inputs!r} ({exc}); "
                "the inputs must fit the op's signature"
            ) from exc
        with candidate_failures(cand.fn, what, direct=True):
            cand_out = cand.fn(*args, **kwargs)
    with candidate_failures(cand.fn, what):
        t_inc, t_cand = time_pair(incumbent.fn, cand.fn, args, kwargs, runs, warmup)
    old_digest = build_contract(cfg).identities.numerical_policy
    result = GateResult(
        op=op,
        incumbent=incumbent.ref,
        candidate=cand.label,
        incumbent_s=t_inc,
        candidate_s=t_cand,
        speedup=t_inc / t_cand if t_cand > 0 else float("inf"),
        min_speedup=min_speedup,
        output_equal=bitwise_equal(ref_out, cand_out),
        new_policy=new_policy,
        old_policy_digest=old_digest,
    )
    with tempfile.TemporaryDirectory() as tmp:
        if lock is None:
            # Baseline: what the incumbent computes now.
            lock = str(Path(tmp) / "incumbent.lock.json")
            write_lock(lock, build_contract(cfg), list(overrides))
        identity = _new_identity(incumbent, cand, candidate_id) if new_policy else None
        with candidate_failures(cand.fn, what), swapped_in(incumbent, cand, new_identity=identity):
            report = verify_lock(lock, build_contract(cfg))
            result.lock_lines = report.lines()
            if new_policy:
                contract = build_contract(cfg)
                result.new_policy_digest = contract.identities.numerical_policy
                if write_lock_to:  # its probe digests are the candidate's: written while it is swapped in
                    write_lock(write_lock_to, contract, list(overrides))
    return result
