"""Bit-level facts about Triton's ``tl.dot`` that a chunk-form CPR (docs/GDN.md, "Design sketch") would rest on.

A decode step that reproduces row t of a training tile must get the same bits for that row whatever the other
rows hold. This probe measures, on the GPU at hand, for each ``input_precision`` (ieee, tf32, tf32x3) and bf16
operands (fp32 accumulate), whether a row of ``C = A @ B (+ acc)`` keeps its bits when:

- ``other_rows``: other rows of A hold other values (a decode tile's rows are other tokens or zeros);
- ``zero_rows``: the rows of A from ``n`` on are zero (a partial chunk, masked loads);
- ``b_rows_beyond_cut``: A is lower triangular (``P = (q k^T) * decay`` masked) and the rows of B from ``n`` on
  differ (``u`` of tokens the decode step has not seen): rows ``< n`` must keep their bits;
- ``position``: the row sits at another position of the tile;
- ``tile_m``: the tile has 16 rows instead of 64 (on Hopper, wgmma needs 64-row tiles, so the two
  likely lower to different MMA instructions);
- ``warps``: the kernel runs with 8 warps instead of 4;
- ``k_padding``: a dot over all of K whose A is zero outside one 16-column block, against the dot over that block
  alone (decode's small blocks of a block-diagonal training tile; the first and the last block);
- ``k_chain``: a dot over all of K whose A is zero from column ``nb * 16`` on, against ``nb`` one-block dots
  accumulated in ascending order (a sum over earlier blocks as one dot or as a chain of block dots);
- ``prep_partial``: our state-pass prep kernel (``gdn_triton._prep_kernel``) on a chunk whose rows from ``n`` on
  are zero (g = beta = k = v = 0) against the full chunk: rows ``< n`` of U0 and W must keep their bits (KD =
  e^{G_C - G} k reads the chunk's last G by definition; it is only used once the chunk is closed).

Every check compares bit patterns (int32 views) and reports the rows that differ. Writes a JSON (``--out``) and
prints a table; exit status 0 (a probe, not a test: the answers are the data).

GPU: ``python3 tools/probe_dot_rows.py --out $OUT/probe_dot_rows.json``. CPU dry run of the plumbing (the interpreter
ignores the precision and its dot is numpy's): ``TRITON_INTERPRET=1 python tools/probe_dot_rows.py --device cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PRECISIONS = ("ieee", "tf32", "tf32x3", "bf16")


@triton.jit
def _tile_dot(
    a_ptr, b_ptr, acc_ptr, c_ptr,
    M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, PREC: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """One tile per program: ``C = A @ B + acc`` (A ``[M, K]``, B ``[K, N]``, all fp32 in memory)."""
    t = tl.program_id(0).to(tl.int64)
    om, on, ok = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + t * M * K + om[:, None] * K + ok[None, :])
    b = tl.load(b_ptr + t * K * N + ok[:, None] * N + on[None, :])
    acc = tl.load(acc_ptr + t * M * N + om[:, None] * N + on[None, :])
    if BF16:  # noqa: SIM108  (a constexpr branch inside the kernel)
        c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        c = tl.dot(a, b, acc, input_precision=PREC)
    tl.store(c_ptr + t * M * N + om[:, None] * N + on[None, :], c)


def tile_dot(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor, prec: str, warps: int = 4) -> torch.Tensor:
    """``a [T, M, K] @ b [T, K, N] + acc`` with one program per tile."""
    t, m, k = a.shape
    n = b.shape[-1]
    c = torch.empty(t, m, n, dtype=torch.float32, device=a.device)
    bf16 = prec == "bf16"
    _tile_dot[(t,)](a, b, acc, c, M=m, N=n, K=k, PREC="ieee" if bf16 else prec, BF16=bf16, num_warps=warps)
    return c


def _rows_differing(x: torch.Tensor, y: torch.Tensor) -> list[int]:
    """Rows (of the last-but-one dim, over all tiles) whose bits differ anywhere."""
    d = (x.contiguous().view(torch.int32) != y.contiguous().view(torch.int32)).flatten(0, -3).any(-1).any(0)
    return [int(i) for i in d.nonzero().flatten()]


def _operands(tiles: int, m: int, n: int, k: int, seed: int, device: str):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randn(tiles, m, k, generator=gen)
    b = torch.randn(tiles, k, n, generator=gen)
    acc = torch.randn(tiles, m, n, generator=gen)
    return a.to(device), b.to(device), acc.to(device)


def dot_checks(device: str, m: int, n: int, k: int, tiles: int) -> list[dict]:
    rows = []
    for prec in PRECISIONS:
        a, b, acc = _operands(tiles, m, n, k, 1, device)
        base = tile_dot(a, b, acc, prec)
        # other_rows: every odd row of A replaced
        a2 = a.clone()
        a2[:, 1::2] = torch.randn_like(a2[:, 1::2])
        diff = [r for r in _rows_differing(base, tile_dot(a2, b, acc, prec)) if r % 2 == 0]
        rows.append({"check": "other_rows", "prec": prec, "rows_checked": m // 2, "rows_differing": diff})
        # zero_rows: rows >= cut of A (and acc) zero
        cut = m // 4 + 1
        a3, acc3 = a.clone(), acc.clone()
        a3[:, cut:] = 0
        acc3[:, cut:] = 0
        diff = [r for r in _rows_differing(base, tile_dot(a3, b, acc3, prec)) if r < cut]
        rows.append({"check": "zero_rows", "prec": prec, "rows_checked": cut, "rows_differing": diff})
        # b_rows_beyond_cut: lower-triangular A [m, m], B rows >= cut differ (and zero)
        lt = torch.tril(torch.randn(tiles, m, m, generator=torch.Generator().manual_seed(2))).to(device)
        bb = torch.randn(tiles, m, n, generator=torch.Generator().manual_seed(3)).to(device)
        acc_m = torch.zeros(tiles, m, n, device=device)
        ref = tile_dot(lt, bb, acc_m, prec)
        for fill in ("random", "zero"):
            b2 = bb.clone()
            b2[:, cut:] = torch.randn_like(b2[:, cut:]) if fill == "random" else 0
            diff = [r for r in _rows_differing(ref, tile_dot(lt, b2, acc_m, prec)) if r < cut]
            rows.append({"check": f"b_rows_beyond_cut ({fill})", "prec": prec, "rows_checked": cut,
                         "rows_differing": diff})  # fmt: skip
        # position: rows shifted cyclically by 17 within the tile
        perm = torch.roll(torch.arange(m), 17)
        moved = tile_dot(a[:, perm], b, acc[:, perm], prec)
        inv = torch.argsort(perm)
        rows.append({"check": "position", "prec": prec, "rows_checked": m,
                     "rows_differing": _rows_differing(base, moved[:, inv])})  # fmt: skip
        # tile_m: the same rows through 16-row tiles
        if m > 16:
            small = tile_dot(
                a.reshape(tiles * m // 16, 16, k),
                b.repeat_interleave(m // 16, 0),
                acc.reshape(tiles * m // 16, 16, n),
                prec,
            ).reshape(tiles, m, n)
            rows.append({"check": f"tile_m (16 vs {m} rows)", "prec": prec, "rows_checked": m,
                         "rows_differing": _rows_differing(base, small)})  # fmt: skip
        rows.append({"check": "warps (8 vs 4)", "prec": prec, "rows_checked": m,
                     "rows_differing": _rows_differing(base, tile_dot(a, b, acc, prec, warps=8))})  # fmt: skip
        # k_padding: a dot over the whole K whose A is zero outside one block of 16 columns, against the dot over
        # that block alone (a block-diagonal tile in training, its one block in decode)
        kb = 16 if k >= 32 else 4  # 16: tl.dot's smallest K on the GPU; the interpreter's tiny shapes take 4
        for blk in (0, k // kb - 1):
            sl = slice(blk * kb, (blk + 1) * kb)
            a_pad = torch.zeros_like(a)
            a_pad[:, :, sl] = a[:, :, sl]
            whole = tile_dot(a_pad, b, acc, prec)
            alone = tile_dot(a[:, :, sl].contiguous(), b[:, sl].contiguous(), acc, prec)
            rows.append({"check": f"k_padding (block {blk} of {k // kb})", "prec": prec, "rows_checked": m,
                         "rows_differing": _rows_differing(whole, alone)})  # fmt: skip
        # k_chain: a dot over the whole K whose A is zero from column nb * 16 on, against nb dots of one 16-column
        # block each, accumulated in ascending order (a substitution's sum over earlier blocks as one dot)
        for nb in (2, k // kb - 1):
            a_pad = torch.zeros_like(a)
            a_pad[:, :, : nb * kb] = a[:, :, : nb * kb]
            chained = acc
            for blk in range(nb):
                sl = slice(blk * kb, (blk + 1) * kb)
                chained = tile_dot(a[:, :, sl].contiguous(), b[:, sl].contiguous(), chained, prec)
            rows.append({"check": f"k_chain ({nb} blocks of {k // kb})", "prec": prec, "rows_checked": m,
                         "rows_differing": _rows_differing(tile_dot(a_pad, b, acc, prec), chained)})  # fmt: skip
    return rows


def prep_partial_checks(device: str, dk: int, chunk: int, heads: int) -> list[dict]:
    """``_prep_kernel`` on one chunk per head (no buffered tokens): full chunk vs rows >= n zeroed."""
    from megatron_iso.ops.gdn import gdn_triton as G

    gen = torch.Generator().manual_seed(5)
    k = torch.nn.functional.normalize(torch.randn(chunk, heads, dk, generator=gen), dim=-1)
    v = torch.randn(chunk, heads, dk, generator=gen)
    g = -torch.rand(chunk, heads, generator=gen) * 0.5
    beta = torch.rand(chunk, heads, generator=gen)
    rows = []
    for prec in G.DOT_PRECISIONS:
        cfg = G.config_for(dk, dk, chunk, prec)

        def prep(n: int, cfg=cfg):
            parts = [x.clone() for x in (k, v, g, beta)]
            for x in parts:
                x[n:] = 0
            rows = tuple(G._rows(x.to(device)) for x in parts)
            # one chunk from packed row 0, none buffered, all rows present
            table = torch.tensor([[0, 0, 0, chunk, 0]], dtype=torch.int32, device=device)
            buf = torch.zeros(1, device=device)
            return G.prep_chunks(rows, (buf, buf, buf, buf), table, cfg)[:2]  # U0, W

        full = prep(chunk)
        for n in sorted({1, chunk // 4, chunk // 4 + 1, chunk // 2 + 3, chunk - 1}):
            part = prep(n)
            for name, x, y in zip(("U0", "W"), full, part, strict=True):
                diff = [r for r in _rows_differing(x[0], y[0]) if r < n]
                rows.append({"check": f"prep_partial {name} n={n}", "prec": prec, "rows_checked": n,
                             "rows_differing": diff})  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", default="probe_dot_rows.json")
    args = ap.parse_args()
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--device cpu needs TRITON_INTERPRET=1 in the environment")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("probe_dot_rows needs a CUDA device (or --device cpu with TRITON_INTERPRET=1)")
    gpu = args.device == "cuda"
    t0 = time.time()
    rows = []
    for m in (64, 128) if gpu else (32,):
        for r in dot_checks(args.device, m, 64 if gpu else 16, 128 if gpu else 16, 8 if gpu else 2):
            rows.append({"M": m, **r})
    rows += prep_partial_checks(args.device, 128 if gpu else 16, 64 if gpu else 16, 4 if gpu else 2)
    print(f"{'check':<30} {'M':>4} {'prec':<7} {'rows':>5}  rows with other bits")
    for r in rows:
        d = r["rows_differing"]
        shown = "none" if not d else f"{len(d)}: {d[:8]}{' ...' if len(d) > 8 else ''}"
        print(f"{r['check']:<30} {r.get('M', '-'):>4} {r['prec']:<7} {r['rows_checked']:>5}  {shown}")
    meta = {"device": torch.cuda.get_device_name() if gpu else "cpu (TRITON_INTERPRET=1)", "torch": torch.__version__,
            "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"), "wall_s": round(time.time() - t0, 1)}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    print(f"wrote {out} ({len(rows)} checks, {meta['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
