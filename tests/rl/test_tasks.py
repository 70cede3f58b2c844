import json

import pytest
from omegaconf import OmegaConf

from megatron_iso.rl.tasks import ByteTokenizer, Prompt, make_task, resolve_reward


def _cfg(**kw):
    base = {"name": "residue", "reward": "residue_match", "tokenizer": "bytes", "prompts_per_step": 3, "prompt_len": 4,
            "modulus": 4, "conditional": True}  # fmt: skip
    return OmegaConf.create(base | kw)


def test_residue_prompts_are_deterministic_per_step_and_reward_counts_matches():
    task = make_task(_cfg(), 256, seed=1)
    a, b, c = task.prompts(5), task.prompts(5), task.prompts(6)
    assert [p.ids for p in a] == [p.ids for p in b] != [p.ids for p in c]
    p = a[0]
    key = p.meta["key"]
    assert task.reward(p, [key, key + 4, key + 1, key + 2]) == 0.5
    assert task.reward(p, []) == 0.0
    unconditional = make_task(_cfg(conditional=False), 256, seed=1)
    assert {q.meta["key"] for q in unconditional.prompts(5)} == {0}


def test_jsonl_math_task_uses_math_verify(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i}+{i}", "answer": str(2 * i)}) for i in range(4)))
    task = make_task(
        _cfg(name="jsonl", reward="math_verify", path=str(data), template="Q: {prompt}\nA: ", prompts_per_step=2),
        256,
        0,
    )
    prompts = task.prompts(0)
    assert len(prompts) == 2
    tok = ByteTokenizer()
    assert tok.decode(prompts[0].ids).startswith("Q: ")
    answer = prompts[0].meta["answer"]
    assert task.reward(prompts[0], tok.encode(f"The answer is {answer}")) == 1.0
    assert task.reward(prompts[0], tok.encode("The answer is 12345")) == 0.0


def test_task_errors_name_the_field(tmp_path):
    with pytest.raises(FileNotFoundError, match="task.path"):
        make_task(
            _cfg(name="jsonl", reward="math_verify", path=str(tmp_path / "nope.jsonl"), template="{prompt}"), 256, 0
        )
    with pytest.raises(ValueError, match=r"task.name='chess'"):
        make_task(_cfg(name="chess"), 256, 0)
    with pytest.raises(ValueError, match=r"task.reward='nope'"):
        resolve_reward("nope")


def test_reward_resolves_from_a_dotted_path():
    fn = resolve_reward("megatron_iso.rl.tasks:residue_match_reward")
    assert fn(Prompt(ids=[3], meta={"key": 3, "modulus": 2}), [1, 2], ByteTokenizer()) == 0.5
