"""The multi-rank test harness: :func:`run_on_ranks` lives in ``megatron_iso.parallel.launch`` (the
tools launch their layouts with it too); re-exported here, where the tests import it from."""

from megatron_iso.parallel.launch import RankFailure, run_on_ranks

__all__ = ["RankFailure", "run_on_ranks"]
