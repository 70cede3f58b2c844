"""What every op family shares: the dispatch rule over the registry (``dispatch``), the one fixed
reduction tree (``tree``), the invariant-forward / plain-backward autograd wrapper (``autograd``), and
the IEEE-composed float64 math library (``ieee_constants``, ``ieee_math`` and its Triton twins
``ieee_math_triton``), a device's SM count for schedule choices (``sm_count``), the record and check of an op's
backend signature (``signatures``), and whether Triton runs under its
CPU interpreter (``interpret``). Nothing here imports an op family."""
