"""A fake op for the iso-gate tests: an incumbent and candidates whose speed is set by sleeping
(robust on a loaded machine) and whose bits are chosen: identical, or one ulp off."""

from __future__ import annotations

import time

import torch

from megatron_iso.registry import OpImpl, register

OP = "gate_fake"


def _work(x: torch.Tensor) -> torch.Tensor:
    return x * 3.0 + 1.0


def incumbent(x: torch.Tensor) -> torch.Tensor:
    time.sleep(0.004)
    return _work(x)


def fast_identical(x: torch.Tensor) -> torch.Tensor:
    time.sleep(0.0005)
    return _work(x)


def slow_identical(x: torch.Tensor) -> torch.Tensor:
    time.sleep(0.012)
    return _work(x)


def fast_different(x: torch.Tensor) -> torch.Tensor:
    time.sleep(0.0005)
    return _work(x).nextafter(torch.tensor(float("inf")))  # one ulp: what a changed kernel looks like


def _probe() -> dict[str, torch.Tensor]:
    return {"out": incumbent(torch.linspace(-2, 2, 16))}  # by module global: the gate's swap reaches it


def inputs() -> tuple[tuple[torch.Tensor], dict]:
    return (torch.linspace(-1, 1, 64),), {}


def register_fakes() -> None:
    for profile in ("correctness", "performance"):
        register(
            OpImpl(
                op=OP,
                impl_id=f"{OP}.{profile}",
                version="1",
                device_class="cpu",
                profile=profile,
                fn=incumbent,
                constants={"accumulate": "fp32"},
                probe=_probe,
            )
        )


register_fakes()
