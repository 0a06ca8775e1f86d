"""Model families: each module turns a ModelConfig (or an HF config.json) into megatron-core parts.

A provider yields a TransformerConfig, a layer spec (Transformer Engine's when TE and CUDA are
present, megatron-core's local modules otherwise) and the GPTModel of one pipeline stage.
"""

import importlib

FAMILIES = {"llama": "model_providers.llama"}


def get_provider(family: str):
    """The provider class of a family, or a one-line error listing the known families."""
    from megatron_rl.config import ConfigError

    if family not in FAMILIES:
        raise ConfigError(f"unknown model.family {family!r}; known families: {', '.join(sorted(FAMILIES))}.")
    return importlib.import_module(FAMILIES[family]).Provider
