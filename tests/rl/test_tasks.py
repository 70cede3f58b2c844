import json
import re

import pytest
from omegaconf import OmegaConf

from megatron_iso.errors import UserError
from megatron_iso.rl.tasks import (
    ByteTokenizer,
    Prompt,
    TaskError,
    check_prompts_fit,
    make_task,
    resolve_reward,
    rollout_refusal,
)
from megatron_iso.settings.compose import conf_dir, load_config
from megatron_iso.testing.harness import run_on_ranks


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


def _jsonl(**kw):
    return _cfg(
        **{"name": "jsonl", "reward": "math_verify", "template": "Q: {prompt}\nA: ", "prompts_per_step": 2} | kw
    )


def test_task_errors_are_user_errors_naming_the_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    missing = re.escape(
        f"task.path='nope.jsonl': no such file ({tmp_path / 'nope.jsonl'} nor {conf_dir() / 'nope.jsonl'})"
    )
    with pytest.raises(TaskError, match=missing):
        make_task(_jsonl(path="nope.jsonl"), 256, 0)
    with pytest.raises(TaskError, match=r"task.name='chess'"):
        make_task(_cfg(name="chess"), 256, 0)
    with pytest.raises(TaskError, match=r"task.reward='nope'"):
        resolve_reward("nope")
    with pytest.raises(TaskError, match=r"task.reward='no_such_module:f': cannot import no_such_module"):
        resolve_reward("no_such_module:f")
    with pytest.raises(TaskError, match=r"task.prompt_len=0 is not allowed"):
        make_task(_cfg(prompt_len=0), 256, 0)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2",\n')
    with pytest.raises(TaskError, match=r"task.path='bad.jsonl': .*bad.jsonl:2 is not JSON"):
        make_task(_jsonl(path="bad.jsonl"), 256, 0)
    (tmp_path / "keys.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    with pytest.raises(TaskError, match=r"keys.jsonl:1 needs 'prompt' and 'answer' keys, got \['answer', 'question'\]"):
        make_task(_jsonl(path="keys.jsonl"), 256, 0)
    (tmp_path / "ok.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    for template in ("Q: {question}", "no prompt here"):
        with pytest.raises(TaskError, match=r"task.template=.* must hold the field \{prompt\}"):
            make_task(_jsonl(path="ok.jsonl", template=template), 256, 0)
    assert issubclass(TaskError, UserError)  # the CLI prints it as one line, exit 2


def test_the_shipped_jsonl_task_runs_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(["task=jsonl_math"]).task
    task = make_task(cfg, 256, 0)
    assert task.file == conf_dir() / str(cfg.path) and task.file.is_file() and len(task.rows) > 10
    # A file of the same relative name in the working directory is the user's: it wins.
    (tmp_path / cfg.path).parent.mkdir(parents=True)
    (tmp_path / cfg.path).write_text(json.dumps({"prompt": "1+1", "answer": "2"}) + "\n")
    mine = make_task(cfg, 256, 0)
    assert mine.file == tmp_path / cfg.path and len(mine.rows) == 1


def test_the_first_prompt_the_rollout_would_refuse_is_named_before_any_step(tmp_path):
    rows = ["1+1", "x" * 40, "2+2", "y" * 50]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": r, "answer": "2"}) + "\n" for r in rows))
    task = make_task(_jsonl(path=str(tmp_path / "d.jsonl")), 256, 0)
    asked = []

    def refusal(n):
        asked.append(n)
        return "too long for the test; lower it" if n > 30 else None

    with pytest.raises(TaskError, match=r"task.path row 1 \(.*d.jsonl:2, with task.template\) has 47 tokens: too long"):
        check_prompts_fit(task, refusal)
    assert asked == [10, 47]  # each length asked once, up to the first refused
    check_prompts_fit(make_task(_cfg(prompt_len=30), 256, 0), refusal)
    with pytest.raises(TaskError, match=r"task.prompt_len=31: every prompt has 31 tokens: too long"):
        check_prompts_fit(make_task(_cfg(prompt_len=31), 256, 0), refusal)


def _refusals_against_the_engine() -> list[tuple[int, int, int, bool, bool]]:
    """(prompt length, group size, max new tokens, refused by rollout_refusal, refused by the engine)."""
    from megatron_iso.inference import Request, SamplingParams
    from megatron_iso.inference.engine import EngineConfig, RolloutEngine
    from tests.inference.engine_cases import setup

    _, model = setup(["model=tiny_dense", "model.max_position_embeddings=48"])
    block = 2 * 2 * 16 * 4 * 16 * 4  # layers x (k, v) x block_size x kv heads x head dim x fp32 bytes
    engine = RolloutEngine(model, EngineConfig(kv_cache_bytes=6 * block, cuda_graphs=False))
    out = []
    for group, new in [(2, 4), (3, 20)]:
        ours = rollout_refusal(engine, new, group)
        for n in range(1, 50):
            params = SamplingParams(max_new_tokens=new, n=group, seed=0, temperature=1.0)
            done = engine.generate([Request(f"{group}:{n}", [7] * n, params)])[0]
            out.append((n, group, new, ours(n) is not None, done.error is not None))
    return out


def test_rollout_refusal_agrees_with_the_engine():
    rows = run_on_ranks(_refusals_against_the_engine, 1)[0]
    assert [r for r in rows if r[3] != r[4]] == []
    assert {r[3] for r in rows} == {True, False}  # both outcomes occur: the comparison means something
    assert any(r[3] and r[0] < 47 for r in rows)  # a refusal for the KV budget, not only for the length


def test_reward_resolves_from_a_dotted_path():
    fn = resolve_reward("megatron_iso.rl.tasks:residue_match_reward")
    assert fn(Prompt(ids=[3], meta={"key": 3, "modulus": 2}), [1, 2], ByteTokenizer()) == 0.5
