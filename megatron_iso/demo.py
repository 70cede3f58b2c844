"""The README's main job (until the RL loop lands): build the tiny model on CPU gloo ranks and
print how far its per-token logprobs move between layouts and batch sizes.

Each row runs the same weights (Megatron's CPU initialisation is seeded on the full weight, then
split) on one layout and compares token logprobs with the TP=1, batch=1 reference.
"""

from __future__ import annotations

import json
import sys

import torch
from rich.console import Console
from rich.table import Table

from megatron_iso.testing.harness import run_on_ranks

VOCAB, SEQ, BATCH = 256, 32, 4


def _token_logprobs(tp: int, sp: bool, batch: int) -> torch.Tensor:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        normalization="RMSNorm",
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        params_dtype=torch.float32,
    )
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)[:batch]
    pos = torch.arange(SEQ)[None].expand(batch, -1)
    mask = torch.ones(batch, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(model(ids, pos, mask))
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1)


LAYOUTS = [
    ("TP=1, batch=1", 1, False, 1),
    ("TP=1, batch=4", 1, False, 4),
    ("TP=2, batch=4", 2, False, 4),
    ("TP=2+SP, batch=4", 2, True, 4),
]


def main() -> int:
    console = Console()
    console.print(
        "[bold]megatron_iso demo[/bold]: tiny GPT (Megatron-Core local spec, native profile) on CPU gloo ranks"
    )
    rows = []
    reference = None
    for name, tp, sp, batch in LAYOUTS:
        logp = run_on_ranks(_token_logprobs, tp, tp=tp, args=(tp, sp, batch))[0]
        if reference is None:
            reference = logp
        diff = (logp.double() - reference.double()).abs()
        bitwise = torch.equal(logp.view(torch.int32), reference.view(torch.int32))
        rows.append(
            {
                "layout": name,
                "max_abs_dlogp": diff.max().item(),
                "mean_abs_dlogp": diff.mean().item(),
                "bitwise": bitwise,
            }
        )
    table = Table(title="sequence 0 token logprobs vs TP=1, batch=1")
    for col in ("layout", "max |dlogp|", "mean |dlogp|", "bitwise equal"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["layout"], f"{r['max_abs_dlogp']:.3e}", f"{r['mean_abs_dlogp']:.3e}", str(r["bitwise"]))
    console.print(table)
    print(json.dumps({"demo": "native_parity", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
