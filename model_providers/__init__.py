"""Model families: each module translates its Hugging Face config and weight names.

`builder.Provider` turns a ModelConfig into megatron-core parts (TransformerConfig, layer specs,
GPTModel per pipeline stage) for every family. A family module (llama.py, qwen.py, ...) holds
what differs between families:

    ARCHITECTURES        the HF `architectures` names it reads
    from_hf(hf) -> ModelConfig        config.json -> ModelConfig (raises ConfigError if unsupported)
    to_hf(model) -> dict              ModelConfig -> config.json (for models trained from scratch)
    weight_rules(model) -> [Rule]     megatron <-> HF weight names and their transforms
"""

import importlib

FAMILIES = {name: f"model_providers.{name}" for name in ("llama", "qwen", "mixtral", "deepseek", "nemotron", "nemotron_h")}


def get_family(family: str):
    """The module of a family, or a one-line error listing the known families."""
    from megatron_rl.config import ConfigError

    if family not in FAMILIES:
        raise ConfigError(f"unknown model.family {family!r}; known families: {', '.join(sorted(FAMILIES))}.")
    return importlib.import_module(FAMILIES[family])


def supported_architectures() -> dict[str, str]:
    """HF architecture name -> family."""
    return {arch: name for name in FAMILIES for arch in get_family(name).ARCHITECTURES}


def family_for_hf(hf: dict) -> str:
    """The family that reads an HF config.json, or a ConfigError listing the supported architectures."""
    from megatron_rl.config import ConfigError

    archs = hf.get("architectures") or []
    known = supported_architectures()
    for arch in archs:
        if arch in known:
            return known[arch]
    raise ConfigError(f"unsupported Hugging Face architecture {', '.join(archs) or '(none given)'}; "
                      f"supported: {', '.join(sorted(known))}.")
