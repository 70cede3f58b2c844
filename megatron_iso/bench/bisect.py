"""First-divergent-op bisect: run two runtime configurations on the same input, digest every op.

A *side* is Hydra overrides plus an execution case (``case=trainer_forward``: one packed training
forward over the full sequences; ``case=prefill_decode``: the prompts prefilled into a KV cache,
then the remaining tokens decoded one step at a time, teacher-forced so both sides see the same
tokens). Each side runs in its own process group (its TP size); forward hooks on every module of
the model record each output (the first tensor of a tuple). Rows are put in one canonical order,
(sequence, position), whatever the case's call structure, and SP-sharded rows are gathered, so:

- an output identical on every TP rank is *replicated* (norms, row-parallel GEMM outputs, whole
  layers): comparable with any other layout;
- an output that differs across TP ranks is *sharded* (column-parallel GEMMs, attention heads):
  comparable rank by rank with a side of the same TP size only.

The first module (in side A's execution order) whose comparable output differs in any bit is
reported with its max |diff|, its digests and the op implementations that serve it on both sides.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_iso.contract.lockfile import tensor_digest
from megatron_iso.errors import UserError
from megatron_iso.testing.bits import same_bits

CASES = ("trainer_forward", "prefill_decode")

# Module-name patterns -> op families of the op registry that serve the module (first match).
# The attention family depends on the case: a cached prefill/decode reads the KV cache.
_OP_FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"(^|\.)core_attention$", ("attention",)),
    (r"layernorm$", ("rmsnorm",)),
    (r"(linear_qkv|linear_proj|linear_fc1|linear_fc2|output_layer|router)$", ("gemm",)),
    (r"(^|\.)word_embeddings$", ("embedding",)),
    (r"(^|\.)experts$", ("gemm", "swiglu", "moe_route_combine")),
    (r"(^|\.)self_attention$", ("gemm", "rmsnorm", "rope", "attention")),
    (r"(^|\.)mlp$", ("gemm", "swiglu")),
    (r"(^|\.)(linear_attention|gdn|mixer)$", ("gated_delta_rule", "gdn_conv1d", "gdn_gates", "gdn_l2norm")),
)


class BisectInputError(UserError, ValueError):
    """A side or an input the bisect cannot run; the message names the setting and its allowed values."""


@dataclass(frozen=True)
class Side:
    overrides: tuple[str, ...]
    case: str = "trainer_forward"

    @property
    def label(self) -> str:
        return " ".join(self.overrides) + f" case={self.case}" if self.overrides else f"case={self.case}"


def parse_side(spec: str) -> Side:
    """``"profile=performance parallel.tp=2 case=prefill_decode"`` -> Side (``case=`` is bisect's own key)."""
    case, overrides = "trainer_forward", []
    for tok in shlex.split(spec):
        if tok.startswith("case="):
            case = tok.split("=", 1)[1]
        else:
            overrides.append(tok)
    if case not in CASES:
        raise BisectInputError(f"case={case!r} is not allowed; allowed values: {list(CASES)}")
    return Side(tuple(overrides), case)


@dataclass(frozen=True)
class BisectInput:
    """The same sequences on both sides: ``num_seqs`` random sequences of ``total_len`` tokens, the
    first ``prompt_len`` of which a prefill_decode side prefills (the rest are decode steps)."""

    num_seqs: int = 2
    prompt_len: int = 6
    total_len: int = 10
    seed: int = 3
    weights_seed: int = 7

    def check(self) -> None:
        """Raise :class:`BisectInputError` naming the first field outside its allowed values."""
        if self.num_seqs < 1:
            raise BisectInputError(f"num_seqs={self.num_seqs} is not allowed; allowed values: integers >= 1")
        if self.total_len < 2:
            raise BisectInputError(f"total_len={self.total_len} is not allowed; allowed values: integers >= 2")
        if not 2 <= self.prompt_len <= self.total_len:
            raise BisectInputError(
                f"prompt_len={self.prompt_len} is not allowed; allowed values: integers from 2 to "
                f"total_len={self.total_len} (a prefill of at least 2 tokens)"
            )

    def sequences(self, vocab: int) -> list[list[int]]:
        self.check()
        g = torch.Generator().manual_seed(self.seed)
        return [torch.randint(0, vocab, (self.total_len,), generator=g).tolist() for _ in range(self.num_seqs)]


# --- one side, on every rank ---------------------------------------------------------------


class _Recorder:
    """Forward hooks on every module; per call, each module's output and which (seq, pos) each row is."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[dict[str, torch.Tensor]] = []
        self.rows: list[list[tuple[int, int]]] = []
        self.order: list[str] = []
        self.kinds: dict[str, str] = {}
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in model.named_modules() if name]
        for name, m in model.named_modules():
            self.kinds[name] = type(m).__name__

    def _hook(self, name: str):
        def hook(_m, _inp, out) -> None:
            t = out[0] if isinstance(out, tuple | list) and out else out
            if not isinstance(t, torch.Tensor):
                return
            if name not in self.calls[-1]:
                self.calls[-1][name] = t.detach().clone()
                if name not in self.order:
                    self.order.append(name)

        return hook

    def run(self, model, ids: torch.Tensor, batch, rows: list[tuple[int, int]]) -> torch.Tensor:
        self.calls.append({})
        self.rows.append(rows)
        return model.forward_packed(ids, batch)

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def _token_dim(t: torch.Tensor, n: int) -> int | None:
    return next((d for d, size in enumerate(t.shape) if size == n), None)


def _gather_sp(t: torch.Tensor, dim: int) -> torch.Tensor:
    from megatron.core import parallel_state

    from megatron_iso.parallel.tree_collectives import gather_along

    return gather_along(t, parallel_state.get_tensor_model_parallel_group(), dim=dim)


def _canonical(rec: _Recorder, tp: int, sp: bool) -> dict[str, torch.Tensor]:
    """Each module's outputs over all calls, rows sorted by (sequence, position), padding dropped."""
    out: dict[str, torch.Tensor] = {}
    for name in rec.order:
        dims, pieces = None, []
        for call, rows in zip(rec.calls, rec.rows, strict=True):
            if name not in call:
                continue
            t, n = call[name], len(rows)
            # The token dim is found in the largest call (a prefill); a 1-row decode call reuses it.
            dim = _token_dim(t, n) if dims is None else dims
            if dim is None and sp and n % tp == 0:
                dim = _token_dim(t, n // tp)
                t = _gather_sp(t, dim) if dim is not None else t
            elif sp and dims is not None and t.shape[dim] * tp == n:
                t = _gather_sp(t, dim)
            if dim is None or t.shape[dim] != n:
                pieces = None
                break
            dims = dim
            pieces.append((t, rows))
        if not pieces:
            continue
        t = torch.cat([p for p, _ in pieces], dim=dims)
        rows = [r for _, rs in pieces for r in rs]
        keep = sorted((r, i) for i, r in enumerate(rows) if r[0] >= 0)
        out[name] = t.index_select(dims, torch.tensor([i for _, i in keep])).contiguous()
    return out


def run_side(config: dict[str, Any], case: str, inp: BisectInput) -> dict[str, Any]:
    """One side on this rank: ``{"outputs": {module: tensor}, "order": [...], "kinds": {...}}``."""
    from megatron_iso.models.batch import pack
    from megatron_iso.models.gpt import build_model
    from megatron_iso.models.transformer_config import transformer_config
    from megatron_iso.models.weights import random_hf_state_dict
    from megatron_iso.ops.attention.kv_cache import KVCache

    tc = transformer_config(config)
    model = build_model(tc, random_hf_state_dict(tc, seed=inp.weights_seed)).eval()
    seqs = inp.sequences(int(tc.vocab_size))
    tp, sp = tc.tensor_model_parallel_size, bool(tc.sequence_parallel)
    rec = _Recorder(model)
    try:
        with torch.no_grad():
            if case == "trainer_forward":
                ids, batch = pack(seqs, pad_to_multiple=tp if sp else 1)
                rows = [(i, p) for i, s in enumerate(seqs) for p in range(len(s))]
                rows += [(-1, j) for j in range(ids.shape[1] - len(rows))]  # SP filler
                rec.run(model, ids, batch, rows)
            else:
                slots = list(range(len(seqs)))
                cache = KVCache.allocate(
                    tc.num_layers,
                    len(seqs),
                    inp.total_len,
                    tc.num_query_groups // tp,
                    tc.kv_channels,
                    dtype=tc.params_dtype,
                )
                p = inp.prompt_len
                ids, batch = pack([s[:p] for s in seqs], case="prefill", kv_cache=cache, slots=slots)
                rec.run(model, ids, batch, [(i, j) for i in slots for j in range(p)])
                cache.advance(slots, [p] * len(seqs))
                for pos in range(p, inp.total_len):
                    ids, batch = pack(
                        [[s[pos]] for s in seqs],
                        start_positions=[pos] * len(seqs),
                        case="decode",
                        kv_cache=cache,
                        slots=slots,
                    )
                    rec.run(model, ids, batch, [(i, pos) for i in slots])
                    cache.advance(slots, [1] * len(seqs))
    finally:
        rec.close()
    return {"outputs": _canonical(rec, tp, sp), "order": rec.order, "kinds": rec.kinds}


# --- the comparison, in the calling process ------------------------------------------------


@dataclass
class OpReport:
    module: str
    kind_a: str
    kind_b: str
    layer: int | None
    ops: tuple[str, ...]
    status: str  # "equal" | "differs"
    mode: str  # "replicated" | "per-rank"
    max_abs_diff: float = 0.0
    shape: tuple[int, ...] = ()
    digest_a: str = ""
    digest_b: str = ""
    impls_a: dict[str, str] = field(default_factory=dict)
    impls_b: dict[str, str] = field(default_factory=dict)


@dataclass
class BisectResult:
    side_a: Side
    side_b: Side
    compared: list[OpReport]
    skipped: list[tuple[str, str]]  # (module, why not comparable)

    @property
    def first_divergence(self) -> OpReport | None:
        return next((r for r in self.compared if r.status == "differs"), None)


def op_families(module: str) -> tuple[str, ...]:
    return next((ops for pat, ops in _OP_FAMILIES if re.search(pat, module)), ())


def _layer(module: str) -> int | None:
    m = re.search(r"layers\.(\d+)", module)
    return int(m.group(1)) if m else None


def _impls(ops: Sequence[str], config: dict[str, Any], case: str) -> dict[str, str]:
    from megatron_iso.contract import load_op_implementations
    from megatron_iso.registry import lookup
    from megatron_iso.settings import resolve_device_class

    load_op_implementations()
    device = resolve_device_class(str(config.get("device", "auto")))
    profile = str(config["profile"]["name"])
    cases = ("trainer_forward",) if case == "trainer_forward" else ("prefill", "decode")
    out = {}
    for op in ops:
        if op == "attention" and case != "trainer_forward":
            op = "attention_kvcache"
        try:
            impl = lookup(op, device, profile)
        except KeyError:
            out[op] = "(not in the registry)"
            continue
        refs = sorted({impl.impl_for(c) for c in cases if c in impl.cases} or {impl.ref})
        out[op] = ",".join(refs)
    return out


def _view(per_rank: list[dict[str, Any]], name: str) -> tuple[str, list[torch.Tensor]] | None:
    ts = [r["outputs"].get(name) for r in per_rank]
    if any(t is None for t in ts):
        return None
    if all(same_bits(t, ts[0]) for t in ts[1:]):
        return "replicated", ts[:1]
    return "sharded", ts


def compare_sides(
    side_a: Side,
    side_b: Side,
    a: list[dict[str, Any]],
    b: list[dict[str, Any]],
    config_a: dict[str, Any],
    config_b: dict[str, Any],
) -> BisectResult:
    """Walk side A's modules in execution order; the rank lists ``a``/``b`` come from :func:`run_side`."""
    compared, skipped = [], []
    for name in a[0]["order"]:
        va, vb = _view(a, name), _view(b, name)
        if va is None or vb is None:
            skipped.append((name, "not produced on both sides"))
            continue
        (ma, ta), (mb, tb) = va, vb
        if ma == mb == "replicated":
            pairs, mode = [(ta[0], tb[0])], "replicated"
        elif len(ta) == len(tb):
            pairs, mode = list(zip(ta, tb, strict=True)), "per-rank"
        else:
            skipped.append((name, f"sharded over {max(len(ta), len(tb))} TP ranks on one side only"))
            continue
        if any(x.shape != y.shape or x.dtype != y.dtype for x, y in pairs):
            skipped.append((name, "shapes or dtypes differ"))
            continue
        same = all(same_bits(x, y) for x, y in pairs)
        ops = op_families(name)
        rep = OpReport(
            module=name,
            kind_a=a[0]["kinds"].get(name, "?"),
            kind_b=b[0]["kinds"].get(name, "?"),
            layer=_layer(name),
            ops=ops,
            status="equal" if same else "differs",
            mode=mode,
            shape=tuple(pairs[0][0].shape),
            digest_a=tensor_digest(pairs[0][0])["sha256"],
            digest_b=tensor_digest(pairs[0][1])["sha256"],
        )
        if not same:
            rep.max_abs_diff = max(float((x.double() - y.double()).abs().max()) for x, y in pairs)
            rep.impls_a = _impls(ops, config_a, side_a.case)
            rep.impls_b = _impls(ops, config_b, side_b.case)
        compared.append(rep)
    return BisectResult(side_a, side_b, compared, skipped)


def side_config(side: Side) -> dict[str, Any]:
    from megatron_iso.settings.compose import load_config, plain_config

    return plain_config(load_config(list(side.overrides)))


def _check_case(side: Side, cfg: dict[str, Any]) -> None:
    from megatron_iso.models.transformer_config import is_hybrid

    if side.case != "prefill_decode":
        return
    if cfg["parallel"].get("sp"):
        raise BisectInputError("case=prefill_decode with parallel.sp=true: the decoder does not run SP")
    if is_hybrid(cfg["model"]):
        # TODO(hybrid): carry a GDNStateCache beside the KV cache (pack(gdn_cache=...)) here.
        raise BisectInputError("case=prefill_decode of a hybrid (GDN) model is not supported yet")


def check_config_runs(cfg: dict[str, Any]) -> None:
    """What a side (or an iso-bench layout) needs beyond a valid config: settings that Megatron can shard
    (``settings.resolve`` checks TP and EP against the model), a contract that builds, one pipeline stage, a
    CUDA device for ``device=cuda``. Errors are UserErrors naming the setting and its allowed values."""
    from megatron_iso.settings import check_runs_here, contract_inputs, resolve

    settings = resolve(cfg)
    contract_inputs(cfg)
    check_runs_here(settings)


def side_configs(side_a: Side, side_b: Side) -> list[dict[str, Any]]:
    """Both sides' resolved configs, checked before any rank starts; an error names the side."""
    from megatron_iso.settings.compose import CONFIG_ERRORS

    configs = []
    for flag, side in (("--a", side_a), ("--b", side_b)):
        try:
            cfg = side_config(side)
            check_config_runs(cfg)
            _check_case(side, cfg)
        except (UserError, *CONFIG_ERRORS) as exc:
            # A side's config error, told as the side's: which of the two sides holds the bad setting.
            raise BisectInputError(f"{flag} {side.label!r}: {' '.join(str(exc).split())}") from exc
        configs.append(cfg)
    return configs


def bisect(side_a: Side, side_b: Side, inp: BisectInput | None = None, launcher: str = "gloo") -> BisectResult:
    """Run both sides (each in its own process group) on the same input and compare op by op; a side or input
    that cannot run raises :class:`BisectInputError` before any rank starts."""
    from megatron_iso.bench.grid import LAUNCHERS, check_launcher

    inp = inp or BisectInput()
    inp.check()
    if launcher not in LAUNCHERS:
        try:
            check_launcher(launcher, "launcher")
        except ValueError as exc:
            raise BisectInputError(str(exc)) from None
    configs = side_configs(side_a, side_b)
    results = []
    for side, cfg in zip((side_a, side_b), configs, strict=True):
        p = cfg["parallel"]
        tp, ep = int(p["tp"]), int(p.get("ep", 1))
        world = math.lcm(tp, ep)  # as in iso-bench: data-parallel ranks hold the extra experts
        results.append(LAUNCHERS[launcher](run_side, world, tp=tp, ep=ep, args=(cfg, side.case, inp)))
    return compare_sides(side_a, side_b, results[0], results[1], configs[0], configs[1])


def format_result(res: BisectResult) -> str:
    lines = [f"A: {res.side_a.label}", f"B: {res.side_b.label}"]
    first = res.first_divergence
    n_equal = sum(r.status == "equal" for r in res.compared)
    if first is None:
        lines.append(f"no divergence: {n_equal} ops compared, every output bitwise identical")
    else:
        before = res.compared.index(first)
        layer = "-" if first.layer is None else str(first.layer)
        lines += [
            f"first divergence: layer {layer}, op {first.module} ({first.kind_a} | {first.kind_b}), "
            f"case {res.side_a.case} | {res.side_b.case}",
            f"  max |diff| {first.max_abs_diff:.6e} over shape {list(first.shape)} ({first.mode})",
            f"  digests: A {first.digest_a[:16]}  B {first.digest_b[:16]}",
            f"  implementations A: {_fmt_impls(first.impls_a)}",
            f"  implementations B: {_fmt_impls(first.impls_b)}",
            f"  {before} ops identical before it; {len(res.compared) - before - 1} compared after it",
        ]
    if res.skipped:
        lines.append(f"not comparable ({len(res.skipped)}): " + ", ".join(f"{m} [{why}]" for m, why in res.skipped))
    return "\n".join(lines)


def _fmt_impls(impls: dict[str, str]) -> str:
    return ", ".join(f"{op}={ref}" for op, ref in impls.items()) or "(no registered op for this module)"
