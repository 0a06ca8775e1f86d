"""Frozen models built from a path in this run's SPMD program and parallel layout: a distillation
teacher, a reward model, the policy whose wrong answers become preference negatives."""

import dataclasses
from pathlib import Path

from megatron_rl.config import Config, LoRAConfig


@dataclasses.dataclass
class Frozen:
    chunks: list  # model chunks without DDP or optimizer, in eval mode, no gradients
    model: object  # its ModelConfig
    tokenizer_dir: Path  # where its tokenizer lies (an HF directory, or a checkpoint's assets)


def freeze(chunks: list) -> list:
    """Model chunks in eval mode with no parameter needing a gradient."""
    for chunk in chunks:
        chunk.eval()
        for p in chunk.parameters():
            p.requires_grad_(False)
    return chunks


def load_frozen(cfg: Config, path: str | Path, head: str | None = None, check=None) -> Frozen:
    """The model at `path` (our checkpoint or run directory, or a Hugging Face directory), built with
    its own architecture in cfg's layout, weights loaded (a LoRA checkpoint's merged into its base), frozen. check(model_config, path, tokenizer_dir)
    may raise (a ConfigError for the wrong kind of model) before anything is built."""
    import torch.distributed as dist

    from megatron_rl import checkpointing
    from megatron_rl.hf import import_hf, model_config_from_hf
    from megatron_rl.training.setup import build_model, load_base

    path = Path(path)
    is_hf = not checkpointing.is_ours(path)
    if is_hf:
        model, tokenizer_dir = model_config_from_hf(path), path
    else:
        path = checkpointing.resolve(path)
        model, tokenizer_dir = checkpointing.read_model_config(path), path / checkpointing.ASSETS
    if check is not None:
        check(model, path, tokenizer_dir)
    saved = None if is_hf else checkpointing.saved_lora(path)
    own = dataclasses.replace(cfg, model=model, lora=LoRAConfig(
        rank=saved["rank"], alpha=saved["alpha"], targets=tuple(saved["targets"])) if saved else LoRAConfig())
    own.parallel.validate(dist.get_world_size(), model)
    chunks, _ = build_model(own, wrap_ddp=False, adapters=bool(saved))
    if is_hf:
        import_hf(chunks, model, path)
    elif saved:  # adapters alone: its base first, then the adapters merged into it
        load_base(chunks, own, checkpoint=str(path))
    else:
        checkpointing.load_weights(chunks, path, head=head or model.head)
    return Frozen(freeze(chunks), model, tokenizer_dir)
