"""``rl.rollout_correction``: the typed group (mode, level, band) the trainer's correction reads (``rl.correction``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

CORRECTION_MODES = ("off", "truncate", "mask", "icepop")
CORRECTION_LEVELS = ("token", "sequence", "geometric")


@dataclass  # not frozen: it is also the rl group's structured-config schema (settings.RLSettings)
class RolloutCorrection:
    """``rl.rollout_correction``: ``mode``, ``level`` and the band ``[lower, upper]`` (``lower`` None: ``1 / upper``,
    verl's default). ``truncate`` reads ``upper`` only."""

    mode: str = "off"
    level: str = "token"
    lower: float | None = None
    upper: float = 2.0

    def __post_init__(self) -> None:
        for name, value, allowed in (("mode", self.mode, CORRECTION_MODES), ("level", self.level, CORRECTION_LEVELS)):
            if value not in allowed:
                raise ValueError(
                    f"rl.rollout_correction.{name}={value!r} is not allowed; allowed values: {list(allowed)}"
                )
        upper = self.upper
        if isinstance(upper, bool) or not isinstance(upper, int | float) or not 1.0 <= upper < math.inf:
            raise ValueError(
                f"rl.rollout_correction.upper={upper!r} is not allowed; allowed values: finite numbers >= 1 "
                "(the band holds ratio 1, where rollout and trainer agree)"
            )
        lower = self.lower
        if lower is not None and (isinstance(lower, bool) or not isinstance(lower, int | float) or not 0 < lower <= 1):
            raise ValueError(
                f"rl.rollout_correction.lower={lower!r} is not allowed; allowed values: null (1 / upper) or "
                "numbers in (0, 1]"
            )

    @property
    def active(self) -> bool:
        return self.mode != "off"

    @property
    def rejects(self) -> bool:
        """Whether rejected tokens leave the loss's normaliser (``mask``): then the old logprobs must be known
        before the update (``rl.ppo.old_logprob_source``)."""
        return self.mode == "mask"

    @property
    def band(self) -> tuple[float, float]:
        return (1.0 / self.upper if self.lower is None else float(self.lower)), float(self.upper)
