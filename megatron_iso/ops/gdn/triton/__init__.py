"""Gated DeltaNet in Triton: the GPU path of the correctness profile (CPR semantics, invariant).

Same signatures as :mod:`megatron_iso.ops.gdn.reference`; not the reference's bits, but the same *structure*, which is
what makes training forward == chunked prefill (any split) == token-by-token decode, bit for bit, for any batch
composition and any subset of heads. Chunks are aligned at position 0 of each sequence. Every block size and warp count
is chosen from (Dk, Dv, chunk) only (:func:`.tuning.config_for`), never from T or the batch. q, k, v, g, beta are read
in their own dtype (fp32, bf16, fp16) at their row stride and widened to fp32 in-kernel, which is exact (other dtypes,
or inner dims that are not contiguous, are copied to contiguous fp32 first). Per-call planning (:mod:`.plan`) needs the
sequence boundaries on the host: one device->host copy per distinct (cu_seqlens, starts, slots), cached across the
layers of a forward. A chunk-form decode step (one token per sequence) is planned by device ops from its starts and
slots instead, so a CUDA graph records it (the engine's decode graphs); only outside a capture is it read back, to be
checked.

State pass (:mod:`.state_pass`): chunk c's exit state from its entry state E. Per chunk, in parallel, the prep kernel:
``G = cumsum(g)`` (an ieee dot with the lower-triangular ones), ``A_ti = beta_t e^{G_t-G_i} k_t.k_i`` (t > i),
``T^{-1}`` of ``T = I + A`` and ``KD = e^{G_C-G} k``. Then one chain program per (sequence, head, Dv block) runs the
chunks in order: ``u = T^{-1}(beta v - beta e^G K E)``, ``E' = e^{G_C} E + KD^T u``.

- Triangular inverse: the ``C / IB`` diagonal blocks X_bb (IB = 16 rows) by explicit fma chains over the rows above,
  all blocks at once (no layout-dependent reduction decides a row, so one row can be recomputed alone with the same
  bits); the block rows below by dots over the blocks to their left, in ascending order.
- K-blocked dots: an fp32 ieee ``tl.dot`` lowers to one fma chain per output element, k ascending, so a dot over K in
  ascending blocks of 16 (``acc = tl.dot(a_blk, b_blk, acc)``) makes the same fmas in the same order as one dot over
  all of K, without holding both operands' whole K extent per thread (which spilled).
- Dot precision (``GDNConfig.prep_precision`` / ``chain_precision``, :data:`.tuning.DOT_PRECISIONS`): "ieee" (fma
  chains), "tf32x3", "tf32" or "bf16" (tensor cores; bf16: operands rounded to bf16, fp32 accumulate). Inside an MMA the
  rounding differs from an fma chain, but the result is still a fixed function of (compiled kernel, operand tiles): no
  atomics, no split-K, blocks in ascending order. Training and rollout run the same kernel on the same closed chunk, so
  they agree at every precision as long as both pass the same one.
- Substitution (chunk form): the chain computes u by block forward substitution over IB-row blocks b in order,
  ``Y_b = beta v_b - (beta e^G k_b) E - sum_{j<b} A_bj u_j`` and ``u_b = X_bb Y_b``, u's blocks in registers; the prep
  writes ``S`` (A's blocks below the diagonal, X_bb on it), ``beta v`` and ``beta e^G k``. The scan form's chain uses
  the WY form, ``u = U0 - W E`` with ``U0 = T^{-1}(beta v)`` and ``W = T^{-1}(beta e^G k)``. A training call's prep
  also writes W and the whole T^{-1}, which the backward reads.
- Intermediate storage: with bf16 chain dots, W and KD (chunk form: u and the entry states) are stored as bf16. Every
  reader of them is a bf16 dot, which rounds an fp32 operand to that same bf16, so the bits are those of fp32 storage.

Output forms (``GDNConfig.form``, per call ``form=``; in the model ``profile.gdn_form``):

- Scan form (:mod:`.scan`, the registered default): one program per (segment, value head, Dv block) holds its
  ``S[Dk, BV]`` block in registers and steps through the segment's tokens: ``S *= exp(g); u = beta (v - S^T k);
  S += k u^T; o = S^T q``. A segment is the part of a call inside one chunk; it starts from the chunk's entry state
  (the state pass's) or from the slot's running state. Training and decode run the same kernel with the same
  constexprs from a bitwise-equal start state (fp32 in memory is exact), so the same bits.
- Chunk form (:mod:`.chunk_out`): outputs as tiles, ``O = e^G (Q E) + P u`` with ``P[t, i] = e^{G_t - G_i} q_t.k_i``
  (i <= t), one program per (chunk, value head, Dv block); the plan lists every chunk the call has tokens in, an open
  last chunk included (its missing rows load as zeros, which leaves the present rows' bits as in the full chunk), and
  the chain stores each chunk's entry state and u for it. Its decode step works row by row, so it takes only the
  precisions whose row bits do not follow a tile's row count (:data:`.tuning.CHUNK_FORM_PRECISIONS`).

Decode (:mod:`.decode`) mirrors training. Scan form: one scan step from the running state; when a step closes a chunk,
the prep and chain kernels run on the buffered chunk (the state cache's ``buf_*`` rows, read exactly as packed rows are)
from the stored entry state, and the exit replaces the running state: the trainer's chunk state, bit for bit. Chunk
form: a step computes its token's rows of the training tiles only: G, A's and P's rows and row t of X_bb (from the
cached rows before it, by the prep's fma chain), then the Y, u and output rows through the chain's 16-row tiles
(earlier Y and u rows from the cache), and the chunk's exit state at its close. Every such dot has the training dot's
K extent and order, and a row's bits depend only on that row and the other operand, so row t is the training tile's.

fp contraction: the chunk form's kernels (prep, chain, output, decode) compile without it (:func:`.tuning.fp_options`):
a decode step redoes the training kernels' arithmetic for one row in another kernel, and
where LLVM contracts ``a * b + c`` into one fma must not depend on the kernel it sits in (contracted, the decode row
kernel fused ``beta v - (beta e^G k) E`` where the chain subtracts from the prep's rounded ``beta v``). The scan form
runs the same kernels on both sides and keeps contraction.

Backward (:mod:`.backward`, training calls): the Triton chunk backward, four kernels, deterministic (not invariant, as
the policy allows), dots at the forward chain's precision; it reads the chunk-form state pass, kept by a chunk-form
forward or recomputed after a scan-form one. conv1d + SiLU, l2norm and the gates: :mod:`.conv_gates`.

Importing the package registers the cuda/correctness implementations (:mod:`.rule`).
"""

from megatron_iso.ops.gdn.triton import rule  # noqa: F401  (importing it registers the implementations)
