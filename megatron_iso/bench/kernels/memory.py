"""The memory-bound ops against the copy bandwidth of the same run: RMSNorm, the logprob scoring kernel, the entropy
statistic (``tools/bench_ops.py`` unless ``--skip-mem``)."""

from __future__ import annotations

from typing import Any

import torch

from megatron_iso.bench.kernels.timing import rand, time_events_ms, time_ms
from megatron_iso.testing.bits import same_bits


def norm_bench(bw: float) -> dict[str, Any]:
    try:
        from megatron_iso.ops.norm.norm_triton import gated_rms_norm_triton, rms_norm_triton
    except ImportError as exc:
        return {"skipped": repr(exc)}
    res: dict[str, Any] = {}
    for T, H in ((16384, 4096), (65536, 2048), (1, 4096), (8192, 8192)):
        x = rand((T, H), torch.bfloat16, 20)
        w = rand((H,), torch.bfloat16, 21)
        z = rand((T, H), torch.bfloat16, 22)
        for name, fn, nbytes in (
            ("plain", lambda x=x, w=w: rms_norm_triton(x, w, 1e-6), 2 * T * H * 2),
            ("gated", lambda x=x, w=w, z=z: gated_rms_norm_triton(x, z, w, 1e-6), 3 * T * H * 2),
        ):
            ms = time_ms(fn)
            gbs = nbytes / ms / 1e6
            res[f"{name}_{T}x{H}"] = {"ms": ms, "GBps": gbs, "of_copy_bw": gbs / bw}
            print(f"rmsnorm {name} {T}x{H}: {ms * 1e3:.1f} us {gbs:.0f} GB/s ({gbs / bw:.2f} of copy)", flush=True)
        full = rms_norm_triton(x, w, 1e-6)
        res[f"row0_bitwise_{T}x{H}"] = all(same_bits(rms_norm_triton(x[:m], w, 1e-6)[0], full[0]) for m in (1, 3, 7))
    return res


def logprob_bench(bw: float) -> dict[str, Any]:
    """The scoring kernel (CUDA correctness profile: one read of the logits per token logprob) against copy
    bandwidth and the torch leaf-tree reference it replaced; row 0's bits at other batch sizes and TP splits."""
    try:
        from megatron_iso.ops.logprob import LocalShards, VocabScores, host_checked_temperature
        from megatron_iso.ops.logprob.logprob_triton import TritonScores, vocab_parallel_check
    except ImportError as exc:
        return {"skipped": repr(exc)}

    temps: dict[tuple[int, float], torch.Tensor] = {}

    def score(lg: torch.Tensor, tgt: torch.Tensor, t: float = 0.7, cls=TritonScores) -> torch.Tensor:
        # A host-checked per-row temperature and ids_in_range: no host reads, so the call is graph-timed as the
        # decode step replays it (event timing of a small call measures Python, not the GPU).
        rows = lg.shape[0]
        if (rows, t) not in temps:
            host = torch.full((rows, 1), t)
            temps[rows, t] = host_checked_temperature(host.to(lg.device), host)
        scores = cls(lg.unsqueeze(0), LocalShards(1), temperature=temps[rows, t], leaves=8)
        return scores.token_logprobs(tgt, ids_in_range=True)

    res: dict[str, Any] = {}
    for T, V in ((4096, 151936), (256, 151936), (64, 151936), (1, 151936), (16384, 32768)):
        logits = rand((T, V), torch.bfloat16, 30) * 4
        tgt = torch.randint(0, V, (T,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(31))
        for dt in (torch.bfloat16, torch.float32):
            lg = logits.to(dt)
            # t = 1 (the usual RL sampling temperature) skips the division per logit; t = 0.7 does not.
            for t in (1.0, 0.7):
                score(lg, tgt, t)  # compiles, and makes the rows' temperature outside the captured call
                ms = time_ms(lambda lg=lg, tgt=tgt, t=t: score(lg, tgt, t))
                ref_ms = time_ms(lambda lg=lg, tgt=tgt, t=t: score(lg, tgt, t, VocabScores))
                gbs = lg.numel() * lg.element_size() / ms / 1e6
                res[f"{dt}_{T}x{V}_t{t}"] = {
                    "ms": ms,
                    "GBps": gbs,
                    "of_copy_bw": gbs / bw,
                    "torch_reference_ms": ref_ms,
                }
                print(
                    f"logprob {dt} {T}x{V} t={t}: {ms * 1e3:.1f} us {gbs:.0f} GB/s ({gbs / bw:.2f} of copy); "
                    f"torch leaf-tree reference {ref_ms * 1e3:.1f} us",
                    flush=True,
                )
        if T >= 4096:
            res[f"reciprocal_{T}x{V}"] = _reciprocal_division_rows(logits, tgt, score, bw)
        else:
            res[f"kernel_warps_{T}x{V}"] = _small_batch_warps_rows(logits)
        full = score(logits, tgt)
        res[f"row0_bitwise_{T}x{V}"] = all(same_bits(score(logits[:m], tgt[:m])[0], full[0]) for m in (1, 3))
        res[f"tp2_bitwise_{T}x{V}"] = vocab_parallel_check(logits, tgt, 0.7, 8, 2)
    return res


def _small_batch_warps_rows(logits: torch.Tensor) -> dict[str, Any]:
    """The scoring kernel alone at a decode batch (graph-timed), one program per (row, leaf) at 1, 2 and 4 warps, at
    t = 1 and t = 0.7 (a tensor temperature: div_rn, as the decode graphs run it; a number: the reciprocal form):
    a few programs walking 19 slices each are latency bound, and more warps shorten each slice. Bits compared
    with 1 warp (the warp count is a schedule choice); ``chosen``: the launch's default (``leaf_kernel_warps``)."""
    from megatron_iso.ops.logprob.logprob_triton import launch_leaf_kernel, leaf_kernel_warps
    from megatron_iso.ops.logprob.temperature_triton import division_args

    rows, vocab = logits.shape
    x = logits.unsqueeze(0)
    out: dict[str, Any] = {"chosen": leaf_kernel_warps(rows)}
    for t, form in ((1.0, "tensor"), (0.7, "tensor"), (0.7, "number")):
        temps = torch.full((rows,), t, device=logits.device)
        args = division_args(t if form == "number" else None, logits.dtype, logits.device)
        ref = torch.empty((1, rows, 8, 2), device=logits.device)
        launch_leaf_kernel(x, temps, ref, vocab, 0, args, num_warps=1)
        row: dict[str, Any] = {}
        for warps in (1, 2, 4):
            per_leaf = torch.empty_like(ref)

            def kernel(per_leaf=per_leaf, warps=warps, temps=temps, args=args):
                launch_leaf_kernel(x, temps, per_leaf, vocab, 0, args, num_warps=warps)

            kernel()
            row[f"w{warps}"] = {"us": time_ms(kernel) * 1e3, "same_bits": same_bits(per_leaf, ref)}
        out[f"t{t}_{form}"] = row
        print(
            f"logprob kernel {tuple(logits.shape)} t={t} ({form}, chosen w{out['chosen']}): "
            + ", ".join(f"{w} {r['us']:.1f} us (same bits {r['same_bits']})" for w, r in row.items()),
            flush=True,
        )
    return out


def _reciprocal_division_rows(logits: torch.Tensor, tgt: torch.Tensor, score, bw: float) -> dict[str, Any]:
    """t = 0.7 as a Python number (the trainer's form: a device-checked reciprocal, ``temperature_triton``)
    against the same temperature as a tensor (div_rn per logit): the whole calls event-timed (the number form
    checks its temperature on the host per call), the scoring kernel alone graph-timed in both forms, and their
    bits."""
    from megatron_iso.ops.logprob import LocalShards
    from megatron_iso.ops.logprob.logprob_triton import TritonScores, launch_leaf_kernel
    from megatron_iso.ops.logprob.temperature_triton import division_args

    out: dict[str, Any] = {}
    rows, vocab = logits.shape
    temps = torch.full((rows,), 0.7, device=logits.device)
    per_leaf = torch.empty((1, rows, 8, 2), device=logits.device)
    for dt in (torch.bfloat16, torch.float16):
        lg = logits.to(dt)

        def by_number(lg=lg):
            return TritonScores(lg.unsqueeze(0), LocalShards(1), temperature=0.7, leaves=8).token_logprobs(
                tgt, ids_in_range=True
            )

        def kernel(args, asm=True, lg=lg, out=per_leaf):  # the leaf kernel alone, as TritonScores launches it
            launch_leaf_kernel(lg.unsqueeze(0), temps, out, vocab, 0, args, asm=asm)

        checked = division_args(0.7, dt, lg.device)
        row = {"reciprocal_checked": checked[2]}
        row["same_bits"] = same_bits(by_number(), score(lg, tgt, 0.7))
        for form, fn in (("number", by_number), ("tensor", lambda lg=lg: score(lg, tgt, 0.7))):
            ms = time_events_ms(fn)
            gbs = lg.numel() * lg.element_size() / ms / 1e6
            row[form] = {"ms": ms, "GBps": gbs, "of_copy_bw": gbs / bw}
        # asm False: tl.exp's subnormal fix-up in every slice (slice_exp_triton), the same bits
        for form, args, asm in (
            ("kernel_reciprocal", checked, True),
            ("kernel_reciprocal_exp_fixup", checked, False),
            ("kernel_div_rn", (1.0, 0.0, False), True),
        ):
            kernel(args, asm)
            ms = time_ms(lambda args=args, asm=asm: kernel(args, asm))
            gbs = lg.numel() * lg.element_size() / ms / 1e6
            row[form] = {"ms": ms, "GBps": gbs, "of_copy_bw": gbs / bw}
        fixup_everywhere = torch.empty_like(per_leaf)
        kernel(checked)
        kernel(checked, False, out=fixup_everywhere)
        row["slice_exp_same_bits"] = same_bits(per_leaf, fixup_everywhere)
        out[str(dt)] = row
        print(
            f"logprob {dt} {tuple(lg.shape)} t=0.7 events: number (reciprocal, checked={row['reciprocal_checked']}) "
            f"{row['number']['ms'] * 1e3:.1f} us ({row['number']['of_copy_bw']:.2f} of copy), tensor (div_rn) "
            f"{row['tensor']['ms'] * 1e3:.1f} us; same bits {row['same_bits']}; kernel alone (graph): reciprocal "
            f"{row['kernel_reciprocal']['ms'] * 1e3:.1f} us ({row['kernel_reciprocal']['of_copy_bw']:.2f} of copy), "
            f"div_rn {row['kernel_div_rn']['ms'] * 1e3:.1f} us, exp fix-up in every slice "
            f"{row['kernel_reciprocal_exp_fixup']['ms'] * 1e3:.1f} us (same bits {row['slice_exp_same_bits']})",
            flush=True,
        )
    return out


def entropy_bench(bw: float) -> dict[str, Any]:
    """The entropy statistic (one pass per vocab leaf) against copy bandwidth and the leaf-tree form it replaced."""
    from megatron_iso.ops.logprob import LocalShards, VocabScores
    from megatron_iso.ops.logprob.entropy import row_entropy

    res: dict[str, Any] = {}
    for T, V in ((4096, 151936), (64, 151936)):
        logits = rand((T, V), torch.bfloat16, 32) * 4
        for dt in (torch.bfloat16, torch.float32):
            lg = logits.to(dt)
            ms = time_events_ms(lambda lg=lg: row_entropy(lg, temperature=0.7, leaves=8))
            tree_ms = time_events_ms(
                lambda lg=lg: VocabScores(lg.unsqueeze(0), LocalShards(1), temperature=0.7).entropy()
            )
            gbs = lg.numel() * lg.element_size() / ms / 1e6
            res[f"{dt}_{T}x{V}"] = {"ms": ms, "GBps": gbs, "of_copy_bw": gbs / bw, "leaf_tree_ms": tree_ms}
            print(
                f"entropy {dt} {T}x{V}: {ms * 1e3:.1f} us {gbs:.0f} GB/s ({gbs / bw:.2f} of copy); "
                f"leaf-tree form {tree_ms * 1e3:.1f} us",
                flush=True,
            )
    return res
