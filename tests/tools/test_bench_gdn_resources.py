"""tools/bench_gdn.py --resources on a CPU machine: every GDN kernel that a decode step, a prefill and a training step
launch compiles for sm_90a (Triton's code generator and its bundled ptxas), for the registered scan form and each
chunk-form precision. The interpreter checks run the kernels as Python and never compile them, so without this a
kernel could stop compiling for the GPU (a tuple Triton cannot lower, a constexpr branch, a register cap ptxas
refuses) and only the next device session would find out."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "bench_gdn.py"
VARIANTS = ("ieee/tf32x3", "chunk:bf16", "chunk:tf32", "chunk:ieee")
# what each call of --resources launches: the scan form's decode is the scan kernel alone, its backward recomputes
# the chunk-form state pass (the "(train)" variants); the chunk form's decode is its two row kernels
BACKWARD = {"_bwd_local_kernel", "_bwd_chain_kernel", "_bwd_output_kernel", "_bwd_wy_kernel", "_prep_kernel (train)"}
SCAN = {"_scan_kernel", "_prep_kernel", "_chain_kernel", "_chain_kernel (train)"} | BACKWARD
CHUNK = {"_prep_kernel", "_chain_kernel", "_chunk_out_kernel", "_buffer_kernel", "_decode_prep_kernel",
         "_decode_row_kernel"} | BACKWARD  # fmt: skip


def test_every_gdn_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    out = tmp_path / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(SCRIPT), "--resources", "--dot-precision", *VARIANTS, "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads(out.read_text())["resources"]
    assert set(got) == set(VARIANTS)
    for variant, r in got.items():
        want = CHUNK if variant.startswith("chunk:") else SCAN
        assert set(r["kernels"]) == want, (variant, sorted(r["kernels"]))
        for name, k in r["kernels"].items():
            assert k["registers"] is not None and 0 < k["registers"] <= 255, (variant, name, k)
            if "maxnreg" in k:  # a register cap is what ptxas allocated up to
                assert k["registers"] <= k["maxnreg"], (variant, name, k)
        # compiled with a launch's specialisations (aligned pointers, strides divisible by 16): the row-major tile
        # loads vectorise, as on the GPU; compiled without them, every load was scalar and ptxas reported kilobytes
        # of spills the GPU's kernels do not have
        for name in ("_prep_kernel", "_chain_kernel"):
            assert r["kernels"][name]["ptx_vector_loads"] > 0, (variant, name, r["kernels"][name])
        # the chunk form's decode kernels redo its training kernels' arithmetic row by row: all of them compile without
        # contraction, so LLVM cannot fuse on one side what the other rounds twice (with it, `beta v - (beta e^G k)
        # E` became one fma in the row kernel, so its Y rows differed from the chain's)
        for name in (
            (CHUNK - BACKWARD - {"_buffer_kernel"}) | {"_prep_kernel (train)"} if variant.startswith("chunk:") else ()
        ):
            k = r["kernels"][name]
            assert not k["enable_fp_fusion"] and k["ptx_contractible_f32"] == 0, (variant, name, k)
