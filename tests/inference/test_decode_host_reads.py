"""Host reads of device tensors (device-to-host syncs on CUDA) in one engine step, counted on CPU.

A read of a device tensor makes the host wait for the GPU, and a step that reads inside its forward
cannot be captured as one CUDA graph (issue 9). ``HostReadCounter`` tracks which tensors a CUDA run
would hold on the device and records every read of one with the place that made it. The claims:
the decode step's reads are the listed ones (none in the model forward, none per layer), the same
for 2 and 4 layers, in both profiles; and the counter does see a read that is there (RoPE's range
check when the batch carries no host bound on the positions).
"""

from __future__ import annotations

import re

import torch

from megatron_iso.testing.harness import run_on_ranks
from megatron_iso.testing.host_reads import HostReadCounter

# (kind, file, function) of every read in one step; line numbers left out on purpose.
EXPECTED = {
    "performance": {
        # tokens, logprobs and top logprobs of all rows: the one read the sampler needs.
        ("tolist", "megatron_iso/inference/engine.py", "_read_into_outputs"),
    },
    "correctness": {
        # The recorded logprob's range check on the sampled ids (a scalar read) is skipped: the engine
        # drew them from this vocab (ids_in_range).
        ("tolist", "megatron_iso/inference/engine.py", "_read_into_outputs"),
    },
}


def _places(summary: dict[tuple[str, str], int]) -> dict[tuple[str, str, str], int]:
    out = {}
    for (kind, where), n in summary.items():
        m = re.fullmatch(r"(.*):\d+ \((.*)\)", where)
        key = (kind, m.group(1), m.group(2)) if m else (kind, where, "?")
        out[key] = out.get(key, 0) + n
    return out


def _decode_reads(profile: str, layers: int, strip_position_bound: bool = False) -> list[dict]:
    """Reads of the prefill step and of two decode steps of a tiny_dense engine (4 requests)."""
    from megatron_iso.inference import EngineConfig, RolloutEngine
    from tests.inference import engine_cases

    tc, model = engine_cases.setup([f"profile={profile}", f"model.num_layers={layers}"])
    steps = []
    with HostReadCounter() as counter:
        counter.seed(model)
        engine = RolloutEngine(model, EngineConfig(kv_cache_bytes=1 << 20, block_size=4, max_num_seqs=8))
        if strip_position_bound:
            forward = engine.forward_fn

            def without_bound(ids, batch):
                batch.max_position = None  # as a hand-built IsoBatch: RoPE reads the positions back
                return forward(ids, batch)

            engine.forward_fn = without_bound
        for r in engine_cases.requests(tc.vocab_size, engine_cases.SPECS[:4], max_new_tokens=8, top_logprobs=2):
            engine.add_request(r)
        # Prefill, then three decode steps. With lookahead a decode step launches the next before reading its
        # own tokens: the first decode step reads nothing, each later one reads its predecessor's draw.
        for _ in range(4):
            counter.clear()
            engine.step()
            steps.append(_places(counter.summary()))
    return steps


def _all_cases() -> dict:
    out = {(p, n): _decode_reads(p, n) for p in ("performance", "correctness") for n in (2, 4)}
    out["stripped"] = _decode_reads("correctness", 2, strip_position_bound=True)
    return out


def test_decode_step_host_reads() -> None:
    res = run_on_ranks(_all_cases, 1)[0]
    for profile, expected in EXPECTED.items():
        for layers in (2, 4):
            prefill, first, *decode = res[(profile, layers)]
            print(f"{profile} {layers} layers: prefill {prefill}, decode {first} {decode}")
            assert first == {}, (profile, layers, first)
            for step in (prefill, *decode):
                assert set(step) == expected, (profile, layers, step)
                assert all(n == 1 for n in step.values()), (profile, layers, step)
        assert res[(profile, 2)] == res[(profile, 4)]  # nothing per layer
    # Without pack's host bound RoPE's range check reads the positions once per step (the first
    # layer's cos/sin serve the others): the counter sees it.
    for step in res["stripped"][:1] + res["stripped"][2:]:
        extra = set(step) - EXPECTED["correctness"]
        assert extra == {("item", "megatron_iso/ops/rope/reference.py", "max_abs_position")}, step


def test_counter_tells_device_from_host() -> None:
    host = torch.tensor([3, 0, 2])
    patched = (torch.Tensor.to, torch.Tensor.tolist, torch.Tensor.cpu, torch.zeros, torch.tensor)
    with HostReadCounter() as c:
        dev = host.to("cpu", non_blocking=True)  # an upload: a new device tensor, the source stays host
        assert c.on_device(dev) and not c.on_device(host) and dev is not host
        host.tolist(), int(host[0]), bool(host.any())  # host reads: free
        assert c.reads == []
        y = dev * 2 + 1  # computed from a device tensor: on the device
        z = torch.zeros(2, device="cpu")  # a factory with an explicit device
        assert c.on_device(y) and c.on_device(z)
        int(y[0]), bool(y.any()), float(z.sum()), y.tolist()
        buf = torch.empty(3, dtype=torch.int64)
        buf.copy_(y)
        assert not c.on_device(buf) and buf.tolist() == [7, 1, 5]  # downloaded: reading it is free
        y.nonzero(), y[y > 3], torch.equal(y, y)
        padded = torch.nn.utils.rnn.pad_sequence([y, y[:1]])  # made inside ATen from device rows: no read
        assert c.on_device(padded)
        back = y.cpu()
        assert not c.on_device(back) and back.tolist() == [7, 1, 5]
        kinds = [r.kind for r in c.reads]
        assert kinds == [
            "item",
            "item",
            "item",
            "tolist",
            "copy_to_host",
            "data_dependent:nonzero",
            "boolean_index:index",
            "scalar:equal",
            "cpu",
        ], kinds
        assert all(r.where.startswith("test_decode_host_reads.py:") for r in c.reads), c.reads
    assert (torch.Tensor.to, torch.Tensor.tolist, torch.Tensor.cpu, torch.zeros, torch.tensor) == patched  # restored
