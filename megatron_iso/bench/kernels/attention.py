"""Attention against SDPA: the prefill / decode forward, the batch-1 decode split, the training backward and its
tile sweep (``tools/bench_ops.py --attention``, ``--attention-split``, ``--attention-backward``,
``--attention-backward-sweep``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from megatron_iso.bench.kernels.timing import rand, time_events_ms, time_ms
from megatron_iso.testing.bits import same_bits

# (rows, warps, stages, park): training tiles timed beside the shipped one (attention_bench's prefill rows). The
# shipped tile parks the running accumulator in fp32 scratch between merges (2 stages: 112 KB of shared memory, two
# programs per SM). Unparked, the 64-row, 4-warp tile keeps a segment's and the running accumulator live (64 x 128
# fp32 each) and spills; 8 warps per 64 rows do not spill; parked at 3 stages a program takes 144 KB, one per SM.
PREFILL_TILE_CANDIDATES = ((64, 4, 3, False), (64, 8, 3, False), (64, 4, 3, True))


def attention_checks() -> dict[str, Any]:
    from megatron_iso.ops.attention import attention_triton as at
    from megatron_iso.ops.attention.forward_launch_triton import AttentionTileConfig as AC

    res: dict[str, Any] = {}
    g = torch.Generator(device="cuda").manual_seed(60)
    L = 300
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(L, h, 128, device="cuda", generator=g).to(dtype) for h in (32, 8, 8))
        train = at.attention_varlen(q, k, v, torch.tensor([0, L]))
        kc = torch.full((2, L, 8, 128), float("nan"), device="cuda", dtype=dtype)
        vc = kc.clone()
        outs = [at.attention_with_kv_cache(q[:65], k[:65], v[:65], kc, vc, torch.tensor([0]), torch.tensor([0, 65]),
                                           slots=torch.tensor([1]))]  # fmt: skip
        for t in range(65, L):
            outs.append(at.attention_with_kv_cache(q[t : t + 1], k[t : t + 1], v[t : t + 1], kc, vc,
                                                   torch.tensor([t]), torch.tensor([0, 1]), slots=torch.tensor([1])))  # fmt: skip
        name = str(dtype).removeprefix("torch.")
        res[f"prefill65_decode_eq_varlen_{name}"] = same_bits(torch.cat(outs), train)
        # information: is BLOCK_M part of the arithmetic? (not claimed; the config is fixed)
        for cfg in (AC(64, 4, 2), AC(128, 4, 2), AC(128, 8, 2)):
            res[f"tile_{cfg.block_m}_{cfg.num_warps}_{cfg.num_stages}_eq_default_{name}"] = same_bits(
                at.attention_varlen(q, k, v, torch.tensor([0, L]), config=cfg), train
            )
    print("attention checks:", res, flush=True)
    return res


def attention_bench() -> list[dict[str, Any]]:
    """Qwen3-8B attention (32 q heads, 8 kv heads, d=128, bf16): prefill (varlen) and decode vs torch SDPA."""
    import torch.nn.functional as F

    from megatron_iso.ops.attention import attention_triton as at
    from megatron_iso.ops.attention import forward_launch_triton as launch

    candidates = [launch.AttentionTileConfig(*shape) for shape in PREFILL_TILE_CANDIDATES]
    rows = []
    hq, hkv, d = 32, 8, 128
    dt = torch.bfloat16
    scale = d**-0.5
    for n_seq, L in ((1, 8192), (4, 2048), (16, 512)):
        T = n_seq * L
        q, k, v = (rand((T, h, d), dt, 70 + i) for i, h in enumerate((hq, hkv, hkv)))
        cu = [i * L for i in range(n_seq + 1)]
        call, out = launch.prepare(q, k, v, None, cu, [0] * n_seq, cu[:-1], scale, 64, None)
        ms = time_ms(call)
        flop = 4 * n_seq * hq * d * L * L / 2
        # Candidate tiles timed beside the shipped one; the tile config (park included) moves no bit, checked.
        tried = []
        for cfg in candidates:
            call_c, out_c = launch.prepare(q, k, v, None, cu, [0] * n_seq, cu[:-1], scale, 64, cfg)
            ms_c = time_ms(call_c)
            tried.append({"tile": dataclasses.astuple(cfg), "ms": ms_c, "tflops": flop / ms_c / 1e9,
                          "same_bits": same_bits(out_c, out)})  # fmt: skip
            del out_c
        # Longer segments (another arithmetic: a tuning candidate for the contract's SEG_BLOCKS, not a schedule):
        # fewer merges of the running accumulator per key, against the split decode's finer grain
        # (attention_decode_split_rows times that side).
        longer = []
        for seg in (4, 8):
            call_s, _ = launch.prepare(q, k, v, None, cu, [0] * n_seq, cu[:-1], scale, 64, None, seg_blocks=seg)
            ms_s = time_ms(call_s)
            longer.append({"seg_blocks": seg, "ms": ms_s, "tflops": flop / ms_s / 1e9})
        qs, ks, vs = (t.view(n_seq, L, -1, d).transpose(1, 2) for t in (q, k, v))
        sdpa = functools.partial(F.scaled_dot_product_attention, qs, ks, vs, is_causal=True, enable_gqa=True)
        ms_sdpa = time_ms(sdpa)
        r = {"case": "prefill", "n_seq": n_seq, "L": L, "tile": dataclasses.astuple(launch.CONFIGS[dt]),
             "ms": ms, "tflops": flop / ms / 1e9, "sdpa_ms": ms_sdpa, "sdpa_tflops": flop / ms_sdpa / 1e9,
             "ratio_to_sdpa": ms_sdpa / ms, "candidates": tried, "longer_segments": longer}  # fmt: skip
        rows.append(r)
        cands = ", ".join(f"{c['tile']}: {c['tflops']:.0f} (same bits {c['same_bits']})" for c in tried)
        segs = ", ".join(f"{x['seg_blocks']} blocks {x['tflops']:.0f}" for x in longer)
        print(f"attn prefill {n_seq}x{L}: ours {r['tflops']:.0f} TFLOP/s (tile {r['tile']}); {cands}; segments of "
              f"{segs}; sdpa {r['sdpa_tflops']:.0f} ({r['ratio_to_sdpa']:.2f}x)", flush=True)  # fmt: skip
    for B, L in ((1, 4096), (32, 4096), (128, 2048), (8, 32768)):
        kc = rand((B, L + 1, hkv, d), dt, 80)
        vc = rand((B, L + 1, hkv, d), dt, 81)
        q = rand((B, hq, d), dt, 82)
        cu = list(range(B + 1))
        call, _ = launch.prepare(q, kc.view(-1, hkv, d), vc.view(-1, hkv, d), None, cu, [L] * B,
                                 [i * (L + 1) for i in range(B)], scale, 64, None)  # fmt: skip
        ms = time_ms(call)
        kn, vn = rand((B, hkv, d), dt, 83), rand((B, hkv, d), dt, 84)
        wrapper = functools.partial(
            at.attention_with_kv_cache, q, kn, vn, kc, vc, torch.full((B,), L), torch.arange(B + 1)
        )
        ms_wrap = time_events_ms(wrapper)
        qs = q.view(B, 1, hq, d).transpose(1, 2)
        ks, vs = kc.transpose(1, 2), vc.transpose(1, 2)
        ms_sdpa = time_ms(functools.partial(F.scaled_dot_product_attention, qs, ks, vs, enable_gqa=True))
        nbytes = 2 * B * (L + 1) * hkv * d * 2
        r = {"case": "decode", "B": B, "L": L, "kernel_ms": ms, "wrapper_ms": ms_wrap, "sdpa_ms": ms_sdpa,
             "GBps": nbytes / ms / 1e6, "sdpa_GBps": nbytes / ms_sdpa / 1e6, "ratio_to_sdpa": ms_sdpa / ms}  # fmt: skip
        rows.append(r)
        print(f"attn decode B={B} L={L}: kernel {ms * 1e3:.1f} us ({r['GBps']:.0f} GB/s), wrapper {ms_wrap * 1e3:.1f} us, "
              f"sdpa {ms_sdpa * 1e3:.1f} us ({r['sdpa_GBps']:.0f} GB/s)", flush=True)  # fmt: skip
    rows += attention_decode_split_rows()
    return rows


def attention_decode_split_rows() -> list[dict[str, Any]]:
    """Decode at Qwen3-0.6B heads (16 q, 8 kv, d=128, bf16), batch 1 and 16: the one-launch schedule (8 or 128
    programs walk every key block) vs the split over key segments, with the key capacity tight and at a decode
    graph's static 32k (most segment programs then find no segment); at batch 1 for segments of 2 kv blocks (the
    contract's) and 4 and 8 (tuning candidates: another size is another arithmetic). ``auto_splits``: what the
    auto schedule takes at the 32k capacity. Bits of split == unsplit checked for each row."""
    from megatron_iso.ops.attention import forward_launch_triton as launch
    from megatron_iso.ops.common.sm_count import sm_count

    rows = []
    hq, hkv, d = 16, 8, 128
    dt = torch.bfloat16
    sms = sm_count(torch.device("cuda"))
    for B in (1, 16):
        for L in (640, 4096):
            k_src, v_src = (rand((B * (L + 1), hkv, d), dt, 85 + i) for i in range(2))
            q = rand((B, hq, d), dt, 87)
            nbytes = 2 * B * (L + 1) * hkv * d * 2
            for seg in (launch.SEG_BLOCKS, 4, 8) if B == 1 else (launch.SEG_BLOCKS,):
                r: dict[str, Any] = {"case": "decode_split", "B": B, "L": L, "heads": [hq, hkv, d], "seg_blocks": seg}
                segments = -(-32768 // (seg * 64))
                r["auto_splits"] = (
                    launch.split_schedule(B * hkv, segments, True, sms, None, B * hq * segments * (d + 2) * 4) > 0
                )
                runs = {}
                for name, split, capacity in (
                    ("unsplit", False, None),
                    ("split", True, None),
                    ("split_32k", True, 32768),
                ):
                    call, out = launch.prepare(q, k_src, v_src, None, list(range(B + 1)), [L] * B,
                                               [i * (L + 1) for i in range(B)], d**-0.5, 64, None,
                                               kv_capacity=capacity, split=split, seg_blocks=seg)  # fmt: skip
                    r[f"{name}_us"] = time_ms(call) * 1e3
                    runs[name] = out
                r["split_eq_unsplit"] = same_bits(runs["split"], runs["unsplit"])
                r["split_32k_eq_unsplit"] = same_bits(runs["split_32k"], runs["unsplit"])
                r["split_GBps"] = nbytes / r["split_us"] / 1e3
                rows.append(r)
                print(f"attn decode B={B} L={L} Qwen3-0.6B heads, segments of {seg} blocks: unsplit "
                      f"{r['unsplit_us']:.1f} us, split {r['split_us']:.1f} us ({r['split_GBps']:.0f} GB/s), split at "
                      f"32k capacity {r['split_32k_us']:.1f} us (auto splits: {r['auto_splits']}); same bits: "
                      f"{r['split_eq_unsplit']}/{r['split_32k_eq_unsplit']}", flush=True)  # fmt: skip
    return rows


BACKWARD_HEADS = (32, 8, 128)  # Qwen3-8B: query heads, kv heads, head dim


def _attention_backward_cases():
    """The backward benchmarks' inputs at ``BACKWARD_HEADS``, bf16: for each workload (16 x 768, 4 x 2048, 1 x 8192
    packed sequences) ``(n_seq, L, q, k, v, upstream gradient, cu_seqlens as a list, cu_seqlens)``."""
    hq, hkv, d = BACKWARD_HEADS
    for n_seq, L in ((16, 768), (4, 2048), (1, 8192)):
        T = n_seq * L
        q, k, v = (rand((T, h, d), torch.bfloat16, 90 + i) for i, h in enumerate((hq, hkv, hkv)))
        g = rand((T, hq, d), torch.bfloat16, 95)
        cu_list = [i * L for i in range(n_seq + 1)]
        yield n_seq, L, q, k, v, g, cu_list, torch.tensor(cu_list, device="cuda")


def attention_backward_bench() -> list[dict[str, Any]]:
    """Training attention backward at Qwen3-8B heads (32 q, 8 kv, d=128, bf16, causal, packed sequences):
    the Triton kernels vs the plain fp32 formula they replace vs SDPA's backward (not deterministic)."""
    import torch.nn.functional as F

    from megatron_iso.ops.attention import autograd as attn_autograd
    from megatron_iso.ops.attention.backward_triton import attention_backward

    rows = []
    hq, _, d = BACKWARD_HEADS
    scale = d**-0.5
    for n_seq, L, q, k, v, g, cu_list, cu in _attention_backward_cases():
        runs = [attention_backward(q, k, v, g, cu, L, scale) for _ in range(2)]
        same = all(same_bits(a, b) for a, b in zip(runs[0][:3], runs[1][:3], strict=True))
        ms = time_events_ms(functools.partial(attention_backward, q, k, v, g, cu, L, scale), rep=10)
        plain_ms = None
        if n_seq * hq * L * L * 4 <= 2 << 30:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = attn_autograd._plain_varlen(*leaves, cu_list, scale, None)
            plain_ms = time_events_ms(
                functools.partial(torch.autograd.grad, out, leaves, g.float(), retain_graph=True), rep=5
            )
        qs, ks, vs = (t.view(n_seq, L, -1, d).transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        gs = g.view(n_seq, L, hq, d).transpose(1, 2)
        sdpa_ms = time_events_ms(
            functools.partial(torch.autograd.grad, out, (qs, ks, vs), gs, retain_graph=True), rep=10
        )
        flop = 2.5 * 4 * n_seq * hq * d * L * L / 2
        r = {"n_seq": n_seq, "L": L, "ms": ms, "tflops": flop / ms / 1e9, "deterministic": same,
             "plain_fp32_ms": plain_ms, "sdpa_ms": sdpa_ms, "ratio_to_sdpa": sdpa_ms / ms}  # fmt: skip
        rows.append(r)
        plain = f"{plain_ms:.2f} ms" if plain_ms is not None else "skipped (memory)"
        print(f"attn backward {n_seq}x{L}: ours {ms:.2f} ms ({r['tflops']:.0f} TFLOP/s, same bits twice: {same}), "
              f"plain fp32 {plain}, sdpa {sdpa_ms:.2f} ms ({r['ratio_to_sdpa']:.2f}x)", flush=True)  # fmt: skip
    return rows


def attention_backward_sweep() -> list[dict[str, Any]]:
    """Tile candidates of the three backward kernels at Qwen3-8B heads (bf16, causal, packed): each kernel's
    candidates in turn with the other two at the shipped tiles, the whole backward timed; every candidate's
    gradients checked for the same bits on a second call and against the shipped tiles' within bf16 rounding (a
    tile changes the rounding, not the function)."""
    from megatron_iso.ops.attention.backward_triton import BackwardTile as T
    from megatron_iso.ops.attention.backward_triton import attention_backward, backward_tiles

    candidates = {  # the 64 x 64 tiles shipped before, the shipped ones, and neighbours of both
        "stats": [T(64, 64, 4, 2), T(128, 64, 8, 2), T(128, 64, 8, 3), T(128, 128, 8, 2), T(256, 64, 8, 2)],
        "dkdv": [T(64, 64, 8, 2), T(128, 64, 8, 2), T(128, 64, 4, 2), T(128, 128, 8, 2), T(64, 128, 8, 3)],
        "dq": [T(64, 64, 4, 2), T(128, 64, 8, 2), T(128, 64, 8, 3), T(64, 128, 4, 3), T(256, 64, 8, 2)],
    }  # fmt: skip
    rows = []
    d = BACKWARD_HEADS[2]
    scale = d**-0.5
    shipped = backward_tiles(torch.bfloat16, d)
    for n_seq, L, q, k, v, g, _, cu in _attention_backward_cases():
        base = attention_backward(q, k, v, g, cu, L, scale, tiles=shipped)
        for kernel, tiles in candidates.items():
            for tile in tiles:
                cfg = dataclasses.replace(shipped, **{kernel: tile})
                r: dict[str, Any] = {"n_seq": n_seq, "L": L, "kernel": kernel, "tile": dataclasses.asdict(tile)}
                try:
                    runs = [attention_backward(q, k, v, g, cu, L, scale, tiles=cfg) for _ in range(2)]
                except Exception as exc:  # a tile past the shared memory: recorded, the sweep goes on
                    r["error"] = repr(exc)[:300]
                    rows.append(r)
                    print(f"attn bwd sweep {n_seq}x{L} {kernel} {tile}: {r['error'][:120]}", flush=True)
                    continue
                r["deterministic"] = all(same_bits(a, b) for a, b in zip(runs[0][:3], runs[1][:3], strict=True))
                pairs = zip(runs[0][:3], base[:3], strict=True)
                r["rel_to_shipped"] = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in pairs)
                r["ms"] = time_events_ms(
                    functools.partial(attention_backward, q, k, v, g, cu, L, scale, tiles=cfg), rep=30
                )
                rows.append(r)
                t = tile
                print(f"attn bwd sweep {n_seq}x{L} {kernel} {t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages}: "
                      f"{r['ms']:.2f} ms, deterministic {r['deterministic']}, rel to shipped "
                      f"{r['rel_to_shipped']:.1e}", flush=True)  # fmt: skip
    return rows
