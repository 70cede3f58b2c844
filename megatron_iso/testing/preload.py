"""Imported once by the multi-rank harness's fork server, so forked ranks start with these loaded."""

from megatron_iso.platform import apply_cpu_patches, silence_expected_cpu_warnings

silence_expected_cpu_warnings()

import megatron.core.models.gpt  # noqa: E402
import megatron.core.optimizer  # noqa: E402
import megatron.core.parallel_state  # noqa: E402
import megatron.core.tensor_parallel  # noqa: E402, F401

apply_cpu_patches()
