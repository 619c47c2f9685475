"""cp_attention: exact context-parallel (ring) attention for PyTorch."""

import runpy
from pathlib import Path

from setuptools import setup

# The supported versions, written once (cp_attention/versions.py imports the standard library only).
FLOORS = runpy.run_path(str(Path(__file__).resolve().parent / "cp_attention" / "versions.py"))["FLOORS"]
# The sub-packages to install, written once in cp_attention/rooms.py (it imports nothing).
ROOMS = runpy.run_path(str(Path(__file__).resolve().parent / "cp_attention" / "rooms.py"))["PACKAGE_ROOMS"]


def floor(package: str) -> str:
    return f"{package}>={FLOORS[package]}"


EXTRAS = {
    # Training (scripts/train.py); also what the examples (examples/), the benchmarks and the studies
    # (benchmarks/, studies/, not installed: run them from a checkout) need for their summaries and the
    # layout comparison.
    "train": ["hydra-core>=1.3", "tqdm"],
    "hf": [floor("transformers")],  # AttentionInterface + AttentionMaskInterface
    # context_parallel_trainer: transformers' Trainer (needs accelerate) and TRL's SFTTrainer
    "trainer": [floor("transformers"), floor("accelerate"), floor("trl")],
    "megatron": [floor("megatron-core")],  # core_attention slot as a builder
    "plots": ["matplotlib>=3.7"],
    # Need a CUDA machine and compile there; never part of "all". flash-attn: kernel="flash_attn"
    # (its private interface is read for 2.6-2.8); transformer-engine: the Megatron adapter's
    # backend="transformer_engine" (imported by megatron-core's TE layer spec, not by us).
    "gpu": ["flash-attn>=2.6,<2.9", "transformer-engine[pytorch]>=2.0"],
    # ring-flash-attn: pure Python, no requirements; the compat tests run it on CPU through a flash-attn stand-in
    # ruff, mypy: pinned, so a new release's rules cannot turn a clean tree red; pytest-xdist: make test-fast's -n 2
    "test": ["pytest>=7", "hypothesis>=6", "pytest-xdist>=3", "ring-flash-attn==0.1.8", "ruff==0.17.6", "mypy==2.4.1"],
}
# The core's rooms (sub-packages), then the rooms above them.
# Everything that installs on a CPU-only machine.
EXTRAS["all"] = sorted({req for name, reqs in EXTRAS.items() if name != "gpu" for req in reqs})

setup(
    name="cp_attention",
    version="0.1.0",
    description="Exact context-parallel (ring) attention for PyTorch: contiguous, zigzag and interleaved layouts",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["cp_attention", *(f"cp_attention.{room}" for room in ROOMS), "cp_attention.integrations",
              "cp_attention.integrations.huggingface", "cp_attention.integrations.megatron"],
    package_dir={"cp_attention.integrations": "integrations"},
    install_requires=[floor("torch")],  # the core needs nothing else; see the extras
    extras_require=EXTRAS,
    license="Apache-2.0",
)
