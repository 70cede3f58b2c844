"""The one place that makes Megatron-Core 0.16.1 run on a CPU with gloo.

Megatron-Core assumes CUDA in a handful of spots. On a machine without CUDA (development and
CI) :func:`apply_cpu_patches` replaces exactly those spots; with CUDA it only gives Megatron's
optional Transformer Engine names a None value when TE is absent (Megatron's own MoE router
otherwise fails with a NameError on a GPU without TE). Each patch says why it exists. No other module in megatron_iso patches Megatron.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch

_APPLIED = False


def _cpu_rng_tracker_class() -> type:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's RNG tracker over the CPU generator (its own reads torch.cuda RNG state)."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise KeyError(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


class _NullStream:
    """Stands in for torch.cuda.Stream: on CPU everything runs in program order."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def record_event(self, event: object = None) -> None:
        return None

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _sp_capable_torch_norm(
    cls: type,
    config: object,
    hidden_size: int,
    eps: float = 1e-5,
    persist_layer_norm: bool = False,
    zero_centered_gamma: bool = False,
    normalization: str = "LayerNorm",
) -> torch.nn.Module:
    kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
    kind = getattr(config, "normalization", normalization)
    if kind not in kinds:
        raise ValueError(f"normalization={kind!r} unsupported by the CPU torch norm; allowed {sorted(kinds)}")
    if getattr(config, "layernorm_zero_centered_gamma", False):
        raise ValueError("layernorm_zero_centered_gamma is not supported by the torch norm; use megatron_iso's norm")
    norm = kinds[kind](normalized_shape=hidden_size, eps=eps)
    for param in norm.parameters():
        param.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
    return norm


_CUDA_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "zeros_like", "empty_like", "arange")


class _CpuDeviceTorch(types.ModuleType):
    """``torch`` as seen by a Megatron module that hard-codes ``device='cuda'`` in tensor factories:
    the same module, except those factories place their tensors on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> object:
        attr = getattr(torch, name)
        if name not in _CUDA_FACTORIES:
            return attr

        def factory(*args: object, **kwargs: object) -> torch.Tensor:
            device = kwargs.get("device")
            if device is not None and str(device).startswith("cuda"):
                kwargs["device"] = "cpu"
            return attr(*args, **kwargs)

        return factory


_MOE_SPLITS = ("input_splits", "output_splits", "output_splits_tp")


def _moe_splits_to_numpy(self: object, point: str, tokens_per_expert: torch.Tensor | None = None) -> object:
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in _MOE_SPLITS:
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _clip_grad_by_total_norm(
    parameters: object, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for p in params:
            grad = getattr(p, attr, None)
            if grad is not None:
                grad.detach().mul_(clip_coeff)


# Megatron warns at import about every optional CUDA library it does not find; on the CPU path
# that is expected and the noise hides real messages.
# Megatron warns at import that Transformer Engine / apex are absent and it falls back to its local code: the
# documented state of every machine without them (the CPU path always, a GPU without TE), so silenced wherever.
_ABSENT_EXTRAS_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
)
# Warnings of Megatron's CUDA-oriented code paths when it runs on the CPU with gloo.
_EXPECTED_CPU_WARNINGS = (
    "full scope is deprecated",
    ".*CUDA_DEVICE_MAX_CONNECTIONS",
    ".*all_gather_into_tensor. is deprecated",
    ".*reduce_scatter_tensor. is deprecated",
)


def silence_expected_cpu_warnings() -> None:
    """Filter Megatron's expected warnings (absent TE / apex anywhere; its CUDA paths on the CPU). Runs when
    ``megatron_iso`` is imported, before anything imports Megatron, so no command prints them."""
    import warnings

    expected = (
        _ABSENT_EXTRAS_WARNINGS if torch.cuda.is_available() else _ABSENT_EXTRAS_WARNINGS + _EXPECTED_CPU_WARNINGS
    )
    for message in expected:
        warnings.filterwarnings("ignore", message=message)


@contextlib.contextmanager
def _cuda_type_names() -> Iterator[None]:
    """While active, ``tensor.type()`` of a CPU float tensor answers with its CUDA name."""
    original = torch.Tensor.type

    def type_(self: torch.Tensor, *args: object, **kwargs: object) -> object:
        name = original(self, *args, **kwargs)
        if not args and not kwargs and isinstance(name, str) and name.startswith("torch.") and not self.is_cuda:
            return name.replace("torch.", "torch.cuda.", 1)
        return name

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def define_absent_te_kernels() -> None:
    """Without Transformer Engine, moe_utils leaves its optional TE kernels undefined instead of None,
    and its router GEMM tests ``te_general_gemm is not None`` (NameError). Needed on a GPU without TE
    too, so this one runs on every machine."""
    from megatron.core.transformer.moe import moe_utils

    for name in ("te_general_gemm", "fused_permute", "fused_permute_with_probs", "fused_unpermute"):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def apply_cpu_patches() -> bool:
    """Patch Megatron-Core for CPU execution when CUDA is absent. Idempotent.

    On every machine it first calls :func:`define_absent_te_kernels`. Returns True if the CPU
    patches were applied (now or earlier), False on a CUDA machine.
    """
    global _APPLIED
    define_absent_te_kernels()
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    silence_expected_cpu_warnings()

    from megatron.core.tensor_parallel import random as mrandom

    # Megatron seeds and forks dropout/init RNG through torch.cuda generators.
    mrandom.CudaRNGStatesTracker = _cpu_rng_tracker_class()
    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    # Activation recompute (tensor_parallel.checkpoint) saves and restores the CPU generator, the tracker's
    # states and the CUDA generator's; without CUDA there is no third one to read or set.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None

    # Megatron allocates buffers with device=torch.cuda.current_device(); on CPU that is "cpu".
    torch.cuda.current_device = lambda: "cpu"

    # The local spec's WrappedTorchNorm refuses sequence parallelism only because apex is absent; a
    # torch norm is SP-capable if its replicated weights are marked so their grads get TP-reduced.
    from megatron.core.transformer import torch_norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(_sp_capable_torch_norm)

    # The optimizer, grad clipping, grad buffers, the local l2-norm helper and the pipeline schedule (its token
    # count) create scalars with device='cuda'; the schedule's p2p exchange synchronises CUDA after each send.
    import megatron.core.distributed.param_and_grad_buffer as grad_buffer
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.utils as mutils

    for module in (optimizer, clip_grads, grad_buffer, mutils, schedules):
        module.torch = _CpuDeviceTorch()
    torch.cuda.synchronize = lambda device=None: None  # on the CPU every op is done when it returns

    # Megatron's clip asserts grads are 'torch.cuda.FloatTensor'; same scaling, any device.
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm

    # The distributed optimizer's constructor accepts only 'torch.cuda.*Tensor' parameter types.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    dist_opt_init = DistributedOptimizer.__init__

    def _dist_opt_init(self: DistributedOptimizer, *args: object, **kwargs: object) -> None:
        with _cuda_type_names():
            dist_opt_init(self, *args, **kwargs)

    DistributedOptimizer.__init__ = _dist_opt_init

    # The MoE all-to-all dispatcher creates a class-wide torch.cuda.Stream for device-to-host copies.
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NullStream()
    # Its device-to-host step runs on CUDA streams; on CPU only its effect remains: numpy split sizes.
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _moe_splits_to_numpy

    _APPLIED = True
    return True
