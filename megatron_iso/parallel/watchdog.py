"""A step-level agreement collective whose failure names itself.

:class:`Agreement` is the one collective a loop runs to agree, step by step, whether any rank of a group still
has work (the rollout's lockstep: ``inference.lockstep``). When it fails (a rank stalled past ``dist_timeout_s``,
stopped, crashed, or waiting in another collective), the error is one line: the collective, the group's ranks,
this rank, and which ranks did not answer. Those are found through the world's store: each rank whose
agreement failed leaves a key there and waits a short grace for its peers' keys; a rank that never leaves its key
was not in the collective. :class:`CollectiveTimeout` is a :class:`~megatron_iso.errors.UserError`, so the
command-line tools print that line and exit with their usage-error code (``cli.exit_codes``: the run cannot
continue as asked) instead of a traceback that points into gloo.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_iso.errors import UserError

# How long a rank whose agreement failed waits for its peers to say they failed too (each store probe is cheap).
_GRACE_S = 3.0
_POLL_S = 0.1


class CollectiveTimeout(UserError, RuntimeError):
    """A collective did not complete (a peer stalled past the timeout, or was lost): names it, its group, this
    rank and the ranks that did not answer."""


def _store() -> Any | None:
    """The default process group's store (torch's, private): None when this torch does not expose it."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except (RuntimeError, ValueError):
        return None


class Agreement:
    """``any(flag)``: True when ``flag`` is set on any rank of ``group`` (an all-reduce of one int, MAX).

    ``what`` names the collective in the error (e.g. ``"rollout lockstep"``); ``device``: where the flag lives
    (the group's backend: CPU for gloo, this rank's GPU for NCCL)."""

    def __init__(self, group: Any, what: str, device: torch.device) -> None:
        self.group, self.what, self.device = group, what, device
        self.ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank()
        self.calls = 0  # every rank of the group counts the same calls: the store keys of one call match

    def any(self, flag: bool) -> bool:
        self.calls += 1
        t = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True).wait()
        except RuntimeError as exc:  # gloo's timeout and lost-peer errors (DistBackendError is one)
            raise CollectiveTimeout(self._failure(exc)) from exc
        return bool(t.item())

    def _failure(self, exc: BaseException) -> str:
        silent = self._silent_peers()
        who = f"rank(s) {silent} did not answer" if silent else "every rank reached it"
        if silent is None:
            who = "the store could not say which rank did not answer"
        reason = " ".join(str(exc).split())[:200]
        return (
            f"{self.what}: all-reduce #{self.calls} over ranks {self.ranks} failed on rank {self.rank} "
            f"(timeout {_timeout_text()}): {who}; a rank stalled, stopped or waits in another collective "
            f"(raise dist_timeout_s if it is only slow). Cause: {reason}"
        )

    def _silent_peers(self) -> list[int] | None:
        """The group's ranks that did not reach this call's agreement (None: no store to ask)."""
        store = _store()
        if store is None:
            return None
        prefix = f"iso_watchdog/{self.what}/{'-'.join(map(str, self.ranks))}/{self.calls}"
        try:
            store.set(f"{prefix}/{self.rank}", "1")
            deadline = time.monotonic() + _GRACE_S
            while True:
                silent = [r for r in self.ranks if not store.check([f"{prefix}/{r}"])]
                if not silent or time.monotonic() > deadline:
                    return silent
                time.sleep(_POLL_S)
        except (RuntimeError, ValueError):  # the store's host is gone too
            return None


def _timeout_text() -> str:
    from megatron_iso.parallel.world import collective_timeout

    t = collective_timeout()
    return "torch's default" if t is None else f"{t / datetime.timedelta(seconds=1):g} s"
