"""Small data for the dataset tests: a GSM8K-shaped parquet and a tokenizer with a chat template, made on the spot."""

from __future__ import annotations

import json
import string
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]


def gsm8k_rows(n: int = 6) -> list[dict[str, str]]:
    """GSM8K's shape: a question, and an answer whose last line is ``#### <number>``."""
    return [
        {
            "question": f"Tom has {i} apples and buys {i + 2} more. How many apples?",
            "answer": f"He has {i} + {i + 2} = {2 * i + 2} apples.\n#### {2 * i + 2}",
        }
        for i in range(n)
    ]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat_tokenizer_dir(path: Path, *, generation_config: bool = True) -> Path:
    """A BPE over the characters of a few sentences (vocab < the tiny models' 256) with a ChatML-style template;
    EOS <|im_end|>, and a generation_config.json that adds <|endoftext|> as a second stop token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = [r["question"] + " " + r["answer"] for r in gsm8k_rows(20)]
    corpus += ["user assistant system \\boxed{} Please reason step by step, and put your final answer within",
               string.ascii_letters + string.digits + string.punctuation]  # fmt: skip
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    if generation_config:
        ids = [fast.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return path
