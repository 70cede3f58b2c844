"""Host reads of device tensors (device-to-host syncs on CUDA) in one trainer step, counted on CPU.

One step is ``Trainer.train_on``, what ``Trainer.step`` calls after the rollout: every micro-batch's
forward and backward, the gradient finalisation, the optimizer step and the step's statistics.
``HostReadCounter`` (tests/inference/test_decode_host_reads.py) records every read of a tensor a CUDA
run would hold on the device, with the place that made it. The claims, on tiny_dense, tiny_moe and
tiny_hybrid_moe (correctness profile, EP 1): the reads are exactly the listed ones, so nothing is read
per MoE or GDN layer and the per-step reads do not depend on the layer count; each extra micro-batch adds
the same fixed set (:data:`PER_MICRO_BATCH`), attention layers included (one read of ``cu_seqlens`` shared by
every layer, forward and backward). The static-shape MoE path the trainer takes at EP 1
gives the eager path's logprobs, loss, gradients and updated weights bit for bit.

What the CPU run cannot see: the CUDA-only code (the Triton GDN plan: one layout read per micro-batch,
forward and backward sharing it, checked here on the plan itself; the Triton attention backward, which
reads nothing) and the CPU-only code it replaces (:data:`CPU_ONLY`).
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from megatron_iso.parallel.world import seed_ranks
from megatron_iso.rl.trainer import Sample, Trainer
from megatron_iso.settings import config_world, resolve
from megatron_iso.settings.compose import load_config
from megatron_iso.testing.bits import bits
from megatron_iso.testing.host_reads import HostReadCounter

Place = tuple[str, str, str]  # (kind, file, function); line numbers left out on purpose

# Once per step, whatever the model, the layer and the micro-batch count.
PER_STEP: dict[Place, int] = {
    # Whether every gradient is finite (rl.nonfinite decides before the optimizer applies them): one flag.
    ("item", "megatron_iso/rl/trainer.py", "_grads_finite"): 1,
    # Megatron's grad norm inside optimizer.step() (its clip decision and the logged grad_norm): one scalar.
    ("item", "megatron_iso/rl/trainer.py", "train_on"): 1,
}
# Once per micro-batch (forward + backward).
PER_MICRO_BATCH: dict[Place, int] = {
    # The response rows' logprobs (and entropies, one stacked tensor): the policy loss runs on the host. Nothing
    # for the target ids' vocab range: pack checks the host ids (pack_micro_batch), not each LM-head chunk.
    ("cpu", "megatron_iso/rl/trainer.py", "_accumulate_grads"): 1,
}
# Once per micro-batch of a model with MoE layers: every layer's expert counts for the grouped GEMM backward,
# one non-blocking copy when the forward ends (ops.gemm.grouped.counts_read_once); nothing waits on it.
PER_MICRO_BATCH_MOE: dict[Place, int] = {("copy_to_host", "megatron_iso/ops/gemm/grouped.py", "close"): 1}
# Once per micro-batch of a model with GDN layers: the layout, read by the first GDN layer and shared by the others
# (the CPU reference's read; on CUDA the Triton plan's, shared by the backward's plan too: test_gdn_plan_reads_once).
PER_MICRO_BATCH_GDN: dict[Place, int] = {("tolist", "megatron_iso/ops/gdn/reference.py", "_read_starts"): 1}
# Once per micro-batch of a model with attention layers (on CUDA too): cu_seqlens, read by the first attention
# layer and shared by the others and by the backward (ops.attention.reference._bounds keeps the host copy).
PER_MICRO_BATCH_ATTENTION: dict[Place, int] = {("tolist", "megatron_iso/ops/attention/reference.py", "_read_bounds"): 1}
# Reads of code that only the CPU runs (per layer per micro-batch): the plain attention backward (CUDA runs the
# Triton backward, no reads) and the GDN torch reference's scan (CUDA runs the Triton kernels).
CPU_ONLY_ATTENTION: dict[Place, int] = {
    ("boolean_index:index", "megatron_iso/ops/attention/autograd.py", "_plain_padded"): 1,
    ("boolean_index:index_put", "megatron_iso/ops/common/autograd.py", "plain_grads"): 1,
}
CPU_ONLY_GDN: dict[Place, int] = {
    ("boolean_index:index", "megatron_iso/ops/gdn/reference.py", "_scan"): 1,
    ("boolean_index:index_put", "megatron_iso/rl/trainer.py", "_accumulate_grads"): 1,  # _scan's backward
}
CPU_ONLY = {**CPU_ONLY_ATTENTION, **CPU_ONLY_GDN}

MODELS = {  # model -> (layer counts compared, the model's layer kinds)
    "tiny_dense": (2, 4),
    "tiny_moe": (2, 4),
    "tiny_hybrid_moe": (4, 8),  # a gated attention layer every 4th, GDN layers between
}
SAMPLES = 6  # micro-batches of 6 (one pass), 3 (two) and 2 (three)
BASE = ["rl.group_size=2", "rl.max_response_length=4", "task.prompts_per_step=3", "profile.gdn_chunk=4"]


def _clear_moe_tracker() -> None:
    """Megatron's per-process MoE aux-loss log is sized by the first model that logs to it: a model with other
    layer counts built later in the process must start from an empty one."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()


@pytest.fixture(autouse=True)
def _fresh_moe_tracker():
    _clear_moe_tracker()
    yield
    _clear_moe_tracker()


def _places(summary: dict[tuple[str, str], int]) -> dict[Place, int]:
    out: Counter = Counter()
    for (kind, where), n in summary.items():
        m = re.fullmatch(r"(.*):\d+ \((.*)\)", where)
        out[(kind, m.group(1), m.group(2)) if m else (kind, where, "?")] += n
    return dict(out)


def _expected(model: str, layers: int, passes: int) -> dict[Place, int]:
    attention = layers // 4 if "hybrid" in model else layers
    gdn = layers - attention
    out: Counter = Counter(PER_STEP)
    per_pass: Counter = Counter(PER_MICRO_BATCH)
    if "moe" in model:
        per_pass.update(PER_MICRO_BATCH_MOE)
    if gdn:
        per_pass.update(PER_MICRO_BATCH_GDN)
    if attention:
        per_pass.update(PER_MICRO_BATCH_ATTENTION)
    for place, n in CPU_ONLY_ATTENTION.items():
        per_pass[place] += n * attention
    for place, n in CPU_ONLY_GDN.items():
        per_pass[place] += n * gdn
    for _ in range(passes):
        out.update(per_pass)
    return dict(+out)  # + drops the places a model has none of


def _beyond_cpu_only(got: dict[Place, int]) -> dict[Place, int]:
    return {p: n for p, n in got.items() if p not in CPU_ONLY}


def _seed(counter: HostReadCounter, trainer: Trainer) -> None:
    """What a CUDA run holds on the device: the weights, their grad buffers and the optimizer's state (torch's
    Adam keeps its step counts on the host unless capturable: left out)."""
    counter.seed(trainer.model)
    counter.seed([p.main_grad for p in trainer.model.parameters() if getattr(p, "main_grad", None) is not None])
    counter.seed([b.grad_data for b in trainer.ddp.buffers + trainer.ddp.expert_parallel_buffers])
    opt = trainer.optimizer
    for part in getattr(opt, "chained_optimizers", [opt]):
        inner = getattr(part, "optimizer", part)
        for state in inner.state.values():
            counter.seed([t for k, t in state.items() if isinstance(t, torch.Tensor) and k != "step"])


def _samples(trainer: Trainer) -> list[Sample]:
    """Responses drawn at random (no rollout: the reads of the train step do not depend on them)."""
    g = torch.Generator().manual_seed(11)
    prompts = trainer.task.prompts(0)
    group = trainer.rl.group_size
    out = []
    for i in range(len(prompts) * group):
        n = 2 + i % 3
        tokens = torch.randint(1, trainer.tc.vocab_size, (n,), generator=g).tolist()
        out.append(Sample(i // group, prompts[i // group], tokens, [-1.0] * n))
    return out


def _advantages(n: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, n)


def _step_reads(
    tmp_path, model: str, layers: int, extra: tuple[str, ...] = (), results: list | None = None
) -> dict[int, dict[Place, int]]:
    """The reads of one train_on per micro-batch count (after a first step that builds the optimizer state).
    ``extra``: more overrides; ``results``: gets each step's logprobs, loss and grad norm, then the weights."""
    overrides = [*BASE, f"model={model}", f"model.num_layers={layers}", f"out_dir={tmp_path / model}", *extra]
    cfg = load_config(overrides)
    _clear_moe_tracker()
    out = {}
    with config_world(cfg) as rank:
        seed_ranks(int(cfg.seed))
        trainer = Trainer(resolve(cfg), rank)
        samples = _samples(trainer)
        assert len(samples) == SAMPLES
        steps = [trainer.train_on(samples, _advantages(SAMPLES))]
        for size, passes in ((SAMPLES, 1), (3, 2), (2, 3)):
            trainer.micro_batch_seqs = size
            with HostReadCounter() as counter:
                _seed(counter, trainer)
                steps.append(trainer.train_on(samples, _advantages(SAMPLES)))
                out[passes] = _places(counter.summary())
        if results is not None:
            results += [[step[k] for k in ("trainer_logp", "loss", "grad_norm")] for step in steps]
            results.append([p.detach().clone() for p in trainer.model.parameters()])
    return out


@contextlib.contextmanager
def _checkpoint_reruns() -> Iterator[list[int]]:
    """Counts the backward reruns of activation-checkpointed layers (Megatron's CheckpointFunction) in the body."""
    from megatron.core.tensor_parallel import random as mrandom

    reran: list[int] = []
    saved = mrandom.CheckpointFunction.__dict__["backward"]
    backward = mrandom.CheckpointFunction.backward
    mrandom.CheckpointFunction.backward = staticmethod(lambda ctx, *g: reran.append(1) or backward(ctx, *g))
    try:
        yield reran
    finally:
        mrandom.CheckpointFunction.backward = saved


# _step_reads' reads, its results and how many checkpointed layers its backward reran.
PlainStep = tuple[dict[int, dict[Place, int]], list, int]


@pytest.fixture(scope="module")
def plain_step(tmp_path_factory):
    """``_step_reads`` of a model at a layer count with its results, each computed once per module: the layer-count
    test and the recompute test's plain side measure the same steps (a tiny_hybrid_moe one costs ~15 s on CI)."""
    done: dict[tuple[str, int], PlainStep] = {}

    def get(model: str, layers: int) -> PlainStep:
        if (model, layers) not in done:
            results: list = []
            with _checkpoint_reruns() as reran:
                reads = _step_reads(tmp_path_factory.mktemp(f"{model}_{layers}"), model, layers, results=results)
            done[model, layers] = (reads, results, len(reran))
        return done[model, layers]

    return get


@pytest.mark.parametrize("model", list(MODELS))
def test_train_step_host_reads(plain_step, model):
    few, many = MODELS[model]
    reads = {layers: plain_step(model, layers)[0] for layers in (few, many)}
    for layers, by_passes in reads.items():
        for passes, got in by_passes.items():
            print(f"{model} {layers} layers, {passes} micro-batches: {sum(got.values())} reads {got}")
            assert got == _expected(model, layers, passes), (layers, passes)

    # Beside the CPU-only reference code, nothing depends on the layers.
    for passes in (1, 2, 3):
        assert _beyond_cpu_only(reads[few][passes]) == _beyond_cpu_only(reads[many][passes]), passes
    # Each micro-batch adds the same reads: none of the step's (PER_STEP) repeats per pass.
    one, two, three = (Counter(reads[few][p]) for p in (1, 2, 3))
    assert two - one == three - two and not (two - one).keys() & PER_STEP.keys()


RECOMPUTE = {
    "full_uniform": ("rl.recompute_granularity=full", "rl.recompute_method=uniform", "rl.recompute_num_layers=1"),
    "full_block": ("rl.recompute_granularity=full", "rl.recompute_method=block", "rl.recompute_num_layers=1"),
}


# Every layer recomputed (no expert GEMM of the forward under autograd), and the first layer only (GDN + MoE; the
# copy then holds a recomputed layer's counts and the autograd ones of the others).
@pytest.mark.parametrize(("model", "recompute"), [("tiny_moe", "full_uniform"), ("tiny_hybrid_moe", "full_block")])
def test_a_recomputing_step_reads_what_a_plain_step_reads(tmp_path, plain_step, model, recompute):
    """Activation recompute reruns layers in the backward, outside the model call's static_shapes: their MoE layers
    take the static path there too and their expert GEMMs the forward's one copy of the counts
    (models.moe.recomputed_static_shapes), so a recomputing step reads what a plain step reads (the eager dispatch
    read the routing back in every recomputed MoE layer), beside the CPU-only GDN reference scan, which a recomputed
    GDN layer runs again; the same bits."""
    layers = MODELS[model][0]
    plain, plain_out, plain_reran = plain_step(model, layers)
    assert plain_reran == 0
    recomputing_out: list = []
    with _checkpoint_reruns() as reran:
        recomputing = _step_reads(tmp_path / recompute, model, layers, RECOMPUTE[recompute], recomputing_out)
    assert reran  # the backward reran checkpointed layers
    for passes, got in recomputing.items():
        print(f"{model} {recompute}, {passes} micro-batches: {sum(got.values())} reads {got}")
    assert {p: _beyond_cpu_only(g) for p, g in recomputing.items()} == {
        p: _beyond_cpu_only(g) for p, g in plain.items()
    }
    reran_scans = {p: Counter(recomputing[p]) - Counter(plain[p]) for p in plain}
    assert all(
        set(more) <= {("boolean_index:index", "megatron_iso/ops/gdn/reference.py", "_scan")}
        for more in reran_scans.values()
    )
    assert all(not Counter(plain[p]) - Counter(recomputing[p]) for p in plain)
    for step, (a, b) in enumerate(zip(plain_out, recomputing_out, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(bits(torch.as_tensor(x)), bits(torch.as_tensor(y))), step


def test_gdn_plan_reads_once() -> None:
    """The Triton GDN plan (CUDA-only, planned on the host): a training forward's scan-form plan and its backward's
    chunk-form plan of the same rows share one read of the layout; a new micro-batch (a new tensor) reads again."""
    from megatron_iso.ops.gdn.triton import plan

    cu = torch.tensor([0, 5, 12, 13], dtype=torch.int32)
    with HostReadCounter() as counter:
        dev = cu.to("cpu")  # the batch's device copy
        for form in ("scan", "chunk", "scan"):
            plan.cached_plan(dev, None, None, 4, False, dev.device, 0, form)
        first = _places(counter.summary())
        counter.clear()
        plan.cached_plan(cu.to("cpu"), None, None, 4, False, cu.device, 0, "scan")
        second = _places(counter.summary())
    assert first == second == {("tolist", "megatron_iso/ops/gdn/triton/plan.py", "_host_lists"): 1}, (first, second)


@pytest.mark.parametrize("model", ["tiny_moe", "tiny_hybrid_moe"])
def test_static_moe_training_step_gives_the_eager_bits(tmp_path, monkeypatch, model):
    """The trainer's MoE layers take the static-shape path at EP 1 (pack_micro_batch): logprobs, loss, statistics,
    accumulated gradients and updated weights are the eager path's bit for bit, over two micro-batches."""
    from megatron_iso.rl import trainer as trainer_module

    real_pack, real_finalize = trainer_module.pack_micro_batch, trainer_module.finalize_model_grads
    runs = {}
    for static in (True, False):
        cfg = load_config([*BASE, f"model={model}", "rl.train_micro_batch_seqs=3", f"out_dir={tmp_path / str(static)}"])
        with config_world(cfg) as rank:
            seed_ranks(int(cfg.seed))
            trainer = Trainer(resolve(cfg), rank)
            grads: dict = {}
            flags = []

            def pack(*a, static=static, flags=flags, **k):
                mb = real_pack(*a, **k)
                flags.append(mb["batch"].static_shapes)
                mb["batch"].static_shapes = static
                return mb

            def finalize(models, *a, trainer=trainer, grads=grads, **k):
                grads.update({n: p.main_grad.clone() for n, p in trainer.model.named_parameters()})
                return real_finalize(models, *a, **k)

            monkeypatch.setattr(trainer_module, "pack_micro_batch", pack)
            monkeypatch.setattr(trainer_module, "finalize_model_grads", finalize)
            out = trainer.train_on(_samples(trainer), _advantages(SAMPLES))
            params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            runs[static] = (out, grads, params, flags)
    (static_out, static_grads, static_params, flags), (eager_out, eager_grads, eager_params, _) = (
        runs[True],
        runs[False],
    )
    assert flags == [True, True]  # the trainer marks its micro-batches static at EP 1
    for key in ("trainer_logp", "entropy"):
        assert torch.equal(bits(static_out[key]), bits(eager_out[key])), key
    for key in ("loss", "grad_norm", "policy/clip_frac"):
        assert torch.equal(bits(static_out[key]), bits(eager_out[key])), key
    expert_grads = [n for n in static_grads if ".experts." in n]
    assert expert_grads and any(bool(static_grads[n].abs().sum() > 0) for n in expert_grads)
    for n, g in static_grads.items():
        assert torch.equal(bits(g), bits(eager_grads[n])), n
    for n, p in static_params.items():
        assert torch.equal(bits(p), bits(eager_params[n])), n
