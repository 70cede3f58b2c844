"""Gated DeltaNet bench, one case's setting: the layer shape, the device, the state pass's variant, seeded inputs,
our rule and FLA's entry points, the state cache, and the ``--tune`` overrides (``tools/bench_gdn.py``).

The setting is module state: a case runs in its own process (``bench_gdn.py --case``), which sets it once from its
command line (``configure``, ``split_variant``, ``apply_tune``) before the case reads it; other modules read it as
``gdn_setup.HK`` and so on, never by ``from`` import (that would copy the value before it is set).
"""

from __future__ import annotations

import time
import traceback

import torch

# Overridden by --shape (the CPU dry run uses tiny heads).
HK, HV, D, CHUNK = 16, 32, 128, 64
DEVICE = "cuda"
# The state pass's dot precision of this case (a case spec's "@P" suffix); None: the dispatching op (registered
# default).
DOT_PRECISION: str | None = None
FORM: str | None = None  # triton.tuning.FORMS; set with the precision by a variant "FORM:P"
VARIANT: str | None = None  # the case's "@..." suffix as given


def configure(device: str, shape: str) -> None:
    """The case's device (``cuda``, or ``cpu`` for the interpreter dry run) and its ``--shape`` (``Hk,Hv,D,chunk``)."""
    global DEVICE
    DEVICE = device
    set_shape(shape)


def set_shape(spec: str) -> None:
    """``--shape`` ``Hk,Hv,D,chunk``; a malformed spec exits naming the flag and the form it takes."""
    global HK, HV, D, CHUNK
    try:
        HK, HV, D, CHUNK = (int(x) for x in spec.split(","))
    except ValueError:
        raise SystemExit(f"--shape {spec!r}: expected Hk,Hv,D,chunk (four integers)") from None
    if HV % HK:
        raise SystemExit(f"--shape {spec!r}: Hv={HV} must be a multiple of Hk={HK}")


def interpreter_setup() -> None:
    """Under TRITON_INTERPRET=1 (CPU dry run): triton 3.6's interpreter cannot loop to a run-time bound
    with numpy 2.x (``int()`` of a 1-element array), and autotuners would time configs on a GPU driver
    that is not there; patch the one conversion and make every config time the same."""
    import triton.runtime.autotuner as autotuner

    from megatron_iso.testing.triton_interpret import allow_runtime_loop_bounds

    allow_runtime_loop_bounds()
    autotuner.Autotuner.do_bench = property(lambda self: lambda fn, quantiles=None: [1.0, 1.0, 1.0])


def our_rule():
    """Our gated delta rule: the dispatching op on CUDA; on CPU the Triton package's own (interpreter); the
    Triton package's with ``dot_precision`` (and ``form``) when the case names a variant (``@P``, ``@FORM:P``)."""
    if VARIANT is not None:
        import functools

        from megatron_iso.ops.gdn.triton.rule import gated_delta_rule as triton_rule

        return functools.partial(triton_rule, dot_precision=DOT_PRECISION, form=FORM)
    if DEVICE == "cuda":
        from megatron_iso.ops.gdn import gated_delta_rule
    else:
        from megatron_iso.ops.gdn.triton.rule import gated_delta_rule
    return gated_delta_rule


def parse_variant(variant: str) -> tuple[str | None, str]:
    """``P`` or ``FORM:P`` -> (form or None, P), both checked against triton.tuning's lists (ValueError)."""
    from megatron_iso.ops.gdn.triton.tuning import FORMS, split_dot_precision

    form, colon, prec = variant.rpartition(":")
    if colon and form not in FORMS:
        raise ValueError(f"variant {variant!r}: form {form!r} must be one of {list(FORMS)}")
    split_dot_precision(prec)
    return (form or None), prec


def split_variant(spec: str) -> str:
    """``kind:size@VARIANT`` -> ``kind:size``, setting DOT_PRECISION, FORM and VARIANT from it."""
    global DOT_PRECISION, FORM, VARIANT
    spec, at, variant = spec.partition("@")
    if at:
        try:
            FORM, DOT_PRECISION = parse_variant(variant)
        except ValueError as e:
            raise SystemExit(f"case {spec}@{variant}: {e}") from None
        VARIANT = variant
    return spec


def make_inputs(b: int, t: int, seed: int):
    """q, k (l2-normalised fp32), v (fp32), g, beta (fp32), shaped [b, t, H, D] / [b, t, H]."""
    from megatron_iso.ops.gdn import native

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = native.l2norm(torch.randn(b, t, HK, D, device=DEVICE, generator=gen))
    k = native.l2norm(torch.randn(b, t, HK, D, device=DEVICE, generator=gen))
    v = torch.randn(b, t, HV, D, device=DEVICE, generator=gen)
    a = torch.randn(b, t, HV, device=DEVICE, generator=gen)
    a_log = torch.empty(HV, device=DEVICE).uniform_(1, 16, generator=gen).log()
    g = -a_log.exp() * torch.nn.functional.softplus(a + 1.0)
    beta = torch.sigmoid(torch.randn(b, t, HV, device=DEVICE, generator=gen))
    return q, k, v, g, beta


def bench_ms(fn, quick: bool) -> float:
    if DEVICE != "cuda":  # dry run: one call after the warm-up call, wall time
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench  # warmup and rep are in ms of GPU time

    return float(do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100, return_mode="median"))


def fla_entry_points():
    """(chunk, fused_recurrent, error): FLA's two entry points, or why they are missing."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # report why, keep our rows
        return None, None, traceback.format_exc(limit=3)
    if DEVICE == "cuda":
        return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, None

    def chunk_standin(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
        # Same call contract as chunk_gated_delta_rule (positional q, k, v, g, beta; [B, T, H, D]).
        return fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, scale=scale, initial_state=initial_state,
                                                output_final_state=output_final_state)  # fmt: skip

    return chunk_standin, fused_recurrent_gated_delta_rule, None


def fla_bwd_unavailable(exc: BaseException) -> str | None:
    """The reason string when ``exc`` is FLA refusing a backward it cannot run correctly here; else None.

    fla-core 0.6.0 raises RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect
    results for gated chunk_bwd_dqkwg (see #640) ...") before launching anything; its fused recurrent
    kernel (the CPU dry run's stand-in) has no backward at all (NotImplementedError)."""
    msg = str(exc)
    known = isinstance(exc, RuntimeError) and ("chunk_bwd_dqkwg" in msg or "upgrade Triton" in msg)
    if known or (isinstance(exc, NotImplementedError) and "Backward" in msg):
        return "unavailable: " + msg.strip().splitlines()[0]
    return None


def fla_bwd_refused() -> str | None:
    """Why FLA will refuse its chunk backward here, read from the flags its own check uses (fla-core 0.6.0,
    ``fla.ops.common.chunk_o.chunk_bwd_dqkwg``), so the bench does not compile and run the backward's first
    kernels only to hit that refusal. None when the flags allow it (or tilelang, FLA's other backend for
    that function, is installed): then the backward is attempted and a refusal is still caught."""
    import importlib.util

    try:
        from fla.ops.common import chunk_o
    except Exception:
        return None
    hopper = getattr(chunk_o, "IS_NVIDIA_HOPPER", False)
    bad_triton = getattr(chunk_o, "TRITON_ABOVE_3_4_0", False) and not getattr(chunk_o, "TRITON_ABOVE_3_7_1", True)
    if DEVICE == "cuda" and hopper and bad_triton and importlib.util.find_spec("tilelang") is None:
        return (
            "unavailable: fla-core refuses gated chunk_bwd_dqkwg on Hopper with 3.4.0 <= Triton < 3.7.1 "
            "(fla issue #640) and tilelang is not installed; not attempted"
        )
    return None


def make_state(slots: int):
    """A state cache as the model allocates one: buf_v in v's dtype (bf16, as the model's), buf_u as the chunk form
    stores u."""
    from megatron_iso.ops.gdn import GDNLayerState
    from megatron_iso.ops.gdn.triton.tuning import state_u_dtype

    form = FORM or "scan"
    u_dtype = state_u_dtype(form, DOT_PRECISION)
    return GDNLayerState.allocate(slots, conv_dim=4, conv_kernel=4, key_heads=HK, value_heads=HV, key_dim=D,
                                  value_dim=D, chunk=CHUNK, dtype=torch.bfloat16, device=DEVICE, form=form,
                                  v_dtype=torch.bfloat16, u_dtype=u_dtype)  # fmt: skip


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


# Tuning constants of ops/gdn/triton/tuning.py (and BWD_*: ops/gdn/triton/backward.py) that --tune may override in a
# run (each is read at launch time).
TUNABLE = (
    "SCAN_BV",
    "SCAN_WARPS",
    "CHAIN_BV",
    "CHAIN_BV_MMA",
    "CHAIN_BV_BF16",
    "CHAIN_WARPS",
    "CHAIN_STAGES",
    "PREP_WARPS",
    "PREP_STAGES",
    "INV_BLOCK",
    "OUT_BV",
    "OUT_WARPS",
    "DECODE_BV",
    "DECODE_WARPS",
    "DECODE_PREP_WARPS",
    "PREP_MAXNREG",
    "CHAIN_MAXNREG",
    "OUT_MAXNREG",
    "SCAN_MAXNREG",
    "DECODE_MAXNREG",
    "DECODE_PREP_MAXNREG",
    "BWD_BV",
    "BWD_CHAIN_BV",
    "BWD_CHAIN_BV_BF16",
    "BWD_KS",
    "BWD_WARPS",
    "BWD_CHAIN_WARPS",
    "BWD_CHAIN_STAGES",
    "BWD_MAXNREG",
    "BWD_CHAIN_MAXNREG",
)


def apply_tune(pairs: list[str]) -> None:
    """``NAME=INT`` pairs onto the GDN Triton package's tuning constants. The kernels' bits follow some of them (the scan's
    layout, the inverse's block); training and rollout in one run use the same values, so the bitwise checks hold."""
    from megatron_iso.ops.gdn.triton import backward as B
    from megatron_iso.ops.gdn.triton import tuning as G

    for pair in pairs:
        name, _, val = pair.partition("=")
        if name not in TUNABLE or not val.lstrip("-").isdigit():
            raise SystemExit(f"--tune {pair!r}: expected NAME=INT with NAME one of {list(TUNABLE)}")
        n = int(val)
        if name.endswith("_MAXNREG"):  # a register cap: 0 (none) or what ptxas accepts for .maxnreg
            if n != 0 and not 24 <= n <= 255:
                raise SystemExit(f"--tune {pair!r}: a register cap is 0 (none) or in 24..255")
        elif n < 1 or (not name.endswith("_STAGES") and n & (n - 1)):
            raise SystemExit(f"--tune {pair!r}: the value must be >= 1, and a power of two unless NAME is *_STAGES")
        setattr(B if name.startswith("BWD_") else G, name, n)
