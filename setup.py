"""Spexis on SGLang: speculative parallelism for pipeline-parallel LLM serving."""

from setuptools import find_packages, setup

setup(
    name="spexis-sglang",
    version="0.1.0",
    description=(
        "Spexis (speculative parallelism, selective speculation, lookahead admission) on "
        "SGLang 0.5.17"
    ),
    package_dir={"": "python"},
    packages=find_packages("python"),
    package_data={"spexis_sglang": ["artifacts/**/*", "cpu_support/**/*", "planning/data/*.json"]},
    include_package_data=True,
    python_requires=">=3.10",
    # A GPU user gets SGLang with its own pins (torch 2.11, sglang-kernel, flashinfer).
    # The CPU environment installs sglang --no-deps (scripts/setup_cpu_env.sh).
    install_requires=["sglang==0.5.17", "numpy", "safetensors", "tqdm"],
    # planner: AIConfigurator's SDK and measured per-operator tables (python -m spexis_sglang.plan
    # --model ... --system ...); pinned, the bridge was written against this release
    extras_require={
        "test": ["pytest", "hypothesis"],
        "plot": ["matplotlib"],
        "planner": ["aiconfigurator-core==0.12.0"],
    },
    entry_points={
        "console_scripts": [
            "spexis-launch-server=spexis_sglang.launch_server:main",
        ],
    },
)
