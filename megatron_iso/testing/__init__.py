"""Test utilities shipped with the package (multi-rank harness, bit-pattern comparisons)."""
