"""Decode graphs of a model with Gated DeltaNet layers (tiny_hybrid: GDN + gated attention, dense MLP), run eagerly on
CPU from the bucket buffers (``enable_decode_graphs(capture=False)``): the GDN layers read each row's state slot from
the bucket's SLOT input row, and padding rows point at the slot cache's scratch slot.

The claims: tokens and logprobs are the eager engine's bits while sequences join at different steps, leave at
different steps (rows go back to padding), the batch walks across buckets and the n samples of a shared prompt fork
its state (copy on write, between steps); a graphed step changes the state of its own rows' slots and of the scratch
slot only (padding never touches a sequence's state), and no sequence is ever given the scratch slot. GDN chunk 4, so
decode steps open and close chunks at every alignment. The captured graph on a GPU: tests/gpu/test_decode_graphs.py.
"""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from megatron_iso.testing.harness import run_on_ranks
from tests.inference import engine_cases

OVERRIDES = ["model=tiny_hybrid", "profile=correctness", "profile.gdn_chunk=4"]


def _snapshot(state) -> dict:
    return {(i, f.name): getattr(layer, f.name).clone() for i, layer in state.layers.items() for f in fields(layer)}


def _touched(before: dict, state) -> set[int]:
    """Slots whose state (any layer, any tensor) differs from ``before``, bit for bit."""
    out = set()
    for (i, name), old in before.items():
        new = getattr(state.layers[i], name)
        if old.numel() == 0:
            continue
        same = (old.view(torch.uint8) == new.view(torch.uint8)).flatten(1).all(1)
        out.update(int(s) for s in torch.nonzero(~same).flatten())
    return out


def _run(static: bool, buckets: list[int] | None) -> dict:
    """:func:`engine_cases.staggered_run` of tiny_hybrid (n = 2 and 3 samples fork shared prompts), recording per
    graphed step its rows' state slots and the slots it changed, and every slot a sequence is ever given."""
    _, model = engine_cases.setup(OVERRIDES)
    steps: list[tuple[list[int], set[int], int]] = []  # per graphed step: its rows' slots, slots touched, rows
    handed: set[int] = set()

    def watch(eng) -> None:
        gdn = eng.gdn
        if static:
            graphs = eng.decode_graphs
            real_step = graphs.decode_step

            def watched(starts, tables, ids, plan=None, gdn_slots=None):
                before = _snapshot(gdn.state)
                with torch.enable_grad():  # as warm() may be called: a bucket's step runs without autograd anyway
                    logits = real_step(starts, tables, ids, plan, gdn_slots)
                assert not logits.requires_grad
                steps.append((list(gdn_slots), _touched(before, gdn.state), graphs._last[0].rows))
                return logits

            graphs.decode_step = watched
        real_prepare = gdn.prepare_append

        def prepare(seq_id, start, count):  # every slot a sequence is ever given
            real_prepare(seq_id, start, count)
            handed.add(gdn.slot_of[seq_id])

        gdn.prepare_append = prepare

    run = engine_cases.staggered_run(model, static=static, buckets=buckets, watch=watch)
    eng = run.engine
    assert "CUDA" in run.graphs_off, run.graphs_off
    return {
        "summary": run.summary,
        "steps": eng.stats.steps,
        "graphed": steps,
        "handed": handed,
        "scratch": eng.gdn.scratch,
        "num_slots": eng.gdn.num_slots,
        "buckets": sorted(rows for rows, _ in eng.decode_graphs._buckets) if static else [],
    }


def _all() -> dict:
    return {"eager": _run(False, None), "static": _run(True, None), "padded": _run(True, [2, 5, 6])}


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_on_ranks(_all, 1)[0]


def test_hybrid_static_decode_steps_give_the_eager_bits(runs) -> None:
    eager = runs["eager"]["summary"]
    assert len(eager) == 12  # 8 requests, 12 samples
    for name in ("static", "padded"):
        engine_cases.assert_same_outputs(eager, runs[name]["summary"], f"{name} vs eager")
        # Every step but the (at most 8, one per request) prefill steps came from bucket buffers.
        graphed = len(runs[name]["graphed"])
        assert graphed >= runs[name]["steps"] - 8 > 0, (graphed, runs[name]["steps"])
    assert len(runs["padded"]["buckets"]) >= 2, runs["padded"]["buckets"]  # the batch moved across buckets


def test_padding_rows_write_only_the_scratch_slot(runs) -> None:
    for name in ("static", "padded"):
        r = runs[name]
        scratch = r["scratch"]
        assert scratch == r["num_slots"] and scratch not in r["handed"], "the scratch slot was given to a sequence"
        padded = scratch_written = 0
        for slots, touched, rows in r["graphed"]:
            assert scratch not in slots and len(set(slots)) == len(slots), slots
            assert touched <= {*slots, scratch}, (slots, touched)  # a graphed step writes its rows' slots only
            assert set(slots) <= touched  # ... every one of them (the check can see a write)
            assert rows > len(slots) or scratch not in touched  # only padding rows write the scratch slot
            padded += rows > len(slots)
            scratch_written += scratch in touched
        # The padding rows' state goes to the scratch slot: the first padded step changes it (later ones write the
        # same bits again: token 0 at position 0, a fresh state).
        assert (padded > 0) == (scratch_written > 0), (padded, scratch_written)
        if name == "padded":
            assert padded > 0
