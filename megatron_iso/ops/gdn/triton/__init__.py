"""Gated DeltaNet in Triton: the GPU path of the correctness profile (CPR semantics, invariant).

Answers ``ops.gdn.backend``'s Protocols with the reference's structure, not its bits: training forward == chunked
prefill (any split) == token-by-token decode, bit for bit, for any batch and any subset of heads. Chunks are aligned
at position 0 of each sequence; every block size and warp count comes from (Dk, Dv, chunk) only
(:func:`.tuning.config_for`), never from T or the batch. Stages: :mod:`.plan` (host plan per call), :mod:`.state_pass`
(prep + chain), the output forms :mod:`.scan` and :mod:`.chunk_out`, :mod:`.decode`, :mod:`.backward`,
:mod:`.conv_gates`; :mod:`.rule` drives them and registers the cuda/correctness implementations on import;
:mod:`.carry` runs the rule with a carried state (``ops.gdn.gated_delta_rule_carry``).

Design: docs/GDN.md, "GPU kernels" and "Kernel design notes".
"""

from megatron_iso.ops.gdn.triton import carry, rule  # noqa: F401  (importing rule registers the implementations)
