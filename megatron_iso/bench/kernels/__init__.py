"""The bodies of the GPU kernel benchmarks that ``tools/bench_ops.py`` and ``tools/bench_gdn.py`` run, by subject.

``timing``: the shared helpers (bit comparison, graph / event timing, copy bandwidth, seeded inputs); ``gemm``,
``attention``, ``moe``, ``memory`` (RMSNorm, logprob, entropy): ``bench_ops``'s sections; ``gdn_setup`` (the case's
shape, device and state-pass variant; inputs; FLA's entry points; ``--tune``), ``gdn_cases`` (the timed and the
mismatch cases) and ``gdn_profile`` (``--profile``, ``--resources``): ``bench_gdn``'s. The tools parse their
command lines, call these and print; every function here needs a CUDA device unless its docstring says otherwise.
"""
