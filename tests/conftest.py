"""Shared pytest setup: CPU platform patches before any test imports Megatron."""

from megatron_iso.platform import apply_cpu_patches

apply_cpu_patches()
