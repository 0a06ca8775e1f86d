"""Hugging Face checkpoints in and out of megatron models, streamed one tensor at a time per rank.

    model_config_from_hf(dir)                   config.json -> ModelConfig (family chosen by architecture)
    import_hf(chunks, model, dir)               HF weights -> this rank's megatron parameters
    export_hf(chunks, model, out, assets)       this rank's parameters -> HF safetensors shards + index
"""

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.config import ConfigError, ModelConfig

from .files import HFCheckpoint, ShardWriter, copy_assets, finish_index
from .weights import export_hf_weights, load_hf_weights

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_FILE = "weight_dtypes.json"  # in the assets: each HF tensor's dtype, so an export restores it


def model_config_from_hf(path: str | Path) -> ModelConfig:
    from model_providers import family_for_hf, get_family

    config = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise ConfigError(f"model.hf_path {str(path)!r} does not exist; point it at a Hugging Face model directory.")
    if not config.is_file():
        raise ConfigError(f"{str(path)!r} is not a Hugging Face model directory (no config.json).")
    hf = json.loads(config.read_text())
    head = hf_head(hf, path)
    if head == "score":  # the family reads the causal LM's config; the head is ours
        hf = {**hf, "architectures": [a.replace(SEQ_CLS, CAUSAL_LM) for a in hf["architectures"]]}
    model = get_family(family_for_hf(hf)).from_hf(hf)
    model.hf_path, model.head = str(path), head
    return model


SEQ_CLS, CAUSAL_LM = "ForSequenceClassification", "ForCausalLM"


def hf_head(hf: dict, path) -> str:
    """'score' for a *ForSequenceClassification config with one label (a reward model), else 'lm'."""
    if not any(a.endswith(SEQ_CLS) for a in hf.get("architectures") or []):
        return "lm"
    labels = hf.get("num_labels") or len(hf.get("id2label") or {0: ""})
    if labels != 1:
        raise ConfigError(f"{str(path)!r} is a sequence classifier with {labels} labels; a reward model has one "
                          f"(num_labels=1).")
    return "score"


def as_reward_model_config(hf_config: dict, pad_token_id) -> dict:
    """A causal LM's config.json -> its *ForSequenceClassification one (one label, a pad token)."""
    import transformers

    archs = [a.replace(CAUSAL_LM, SEQ_CLS) for a in hf_config.get("architectures", [])]
    missing = [a for a in archs if not hasattr(transformers, a)]
    if missing or not archs:
        raise ConfigError(f"transformers has no {', '.join(missing) or 'sequence-classification'} class to export "
                          f"this reward model to.")
    if pad_token_id is None:
        raise ConfigError("a reward model's export needs a pad token (transformers reads the score at the last "
                          "non-pad token); give the tokenizer one.")
    out = {**hf_config, "architectures": archs, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0},
           "pad_token_id": pad_token_id}
    out.pop("num_labels", None)
    return out


def resolve_model(model: ModelConfig) -> ModelConfig:
    """The architecture from model.hf_path's config.json, keeping `model`'s training choices."""
    from model_providers.heads import starts_fresh

    resolved = model_config_from_hf(model.hf_path)
    if resolved.head == "score" and model.head == "lm":
        starts_fresh(resolved.head, model.head, f"model.hf_path={model.hf_path!r}")  # refuses
    for name in ModelConfig.TRAINING_CHOICES:
        if name != "hf_path":
            setattr(resolved, name, getattr(model, name))
    return resolved


def import_hf(model_chunks: list, model: ModelConfig, path: str | Path, allow_pickle: bool = False):
    """Load an HF checkpoint into this rank's model chunks (any TP/PP/EP layout). A reward model
    (model.head=score) loads a causal LM's weights but its lm_head, keeping its fresh score head."""
    from dataclasses import replace

    from model_providers import get_family
    from model_providers.heads import starts_fresh

    family = get_family(model.family)
    checkpoint = HFCheckpoint(path, allow_pickle)
    source_head = hf_head(checkpoint.config, path)
    fresh = starts_fresh(source_head, model.head, f"{str(path)!r}")
    skipped = getattr(family, "skipped", None)
    if fresh:
        def skipped(name, m, family_skipped=skipped):
            if name == "lm_head.weight":
                return "a reward model replaces the language-model head with a score head"
            return family_skipped(name, m) if family_skipped else None
    rules = family.weight_rules(replace(model, head=source_head))
    load_hf_weights(model_chunks, model, rules, checkpoint, skipped, fresh={"score_head.weight"} if fresh else set())


def write_assets(hf_path: str | Path, out: str | Path, tokenizer=None, allow_pickle: bool = False):
    """The HF files an export needs later: the source's config, generation config and tokenizer
    files, each tensor's dtype, and (if given) the tokenizer actually used."""
    out = Path(out)
    if hf_path:
        copy_assets(hf_path, out)
        ckpt = HFCheckpoint(hf_path, allow_pickle)
        dtypes = {name: _dtype_name(ckpt.dtype_of(name)) for name in sorted(ckpt.names())}
        (out / DTYPE_FILE).write_text(json.dumps(dtypes, indent=0))
    if tokenizer is not None:
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(out))


def export_hf(model_chunks: list, model: ModelConfig, out: str | Path, assets: str | Path | None = None,
              dtype: torch.dtype | None = None, max_shard_bytes: int = 5 << 30, overwrite: bool = False) -> Path:
    """Write an HF model directory from the model chunks of every rank (all ranks call this).

    Tensors keep the dtypes the model was imported with (assets/weight_dtypes.json), else `dtype`
    (default: the HF config's, else the parameters'). Written into a temporary directory that
    replaces `out` only when complete, so a failure leaves nothing half-written.
    """
    from model_providers import get_family

    out = Path(out)
    assets = Path(assets) if assets else None
    if out.exists() and not overwrite:
        raise ConfigError(f"{str(out)!r} already exists; choose another directory or pass --overwrite.")
    family = get_family(model.family)
    tok = None
    if assets and (assets / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(assets))
    if assets and (assets / "config.json").is_file():
        hf_config = json.loads((assets / "config.json").read_text())
    else:
        hf_config = family.to_hf(model)
        if tok is not None:
            hf_config.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    if model.head == "score":
        hf_config = as_reward_model_config(hf_config, tok.pad_token_id if tok is not None else
                                           hf_config.get("pad_token_id"))
    dtype = dtype or _config_dtype(hf_config) or next(model_chunks[0].parameters()).dtype
    saved = json.loads((assets / DTYPE_FILE).read_text()) if assets and (assets / DTYPE_FILE).is_file() else {}

    tmp = staging_dir(out)
    if dist.get_rank() == 0:
        tmp.mkdir(parents=True)
    dist.barrier()
    try:
        writer = _DtypeWriter(ShardWriter(tmp, dist.get_rank(), max_shard_bytes), saved)
        export_hf_weights(model_chunks, model, family.weight_rules(model), writer, dtype)
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, writer.close())
        if dist.get_rank() == 0:
            finish_index(tmp, [f for rank_files in parts for f in rank_files])
            if assets:
                copy_assets(assets, tmp)
                (tmp / DTYPE_FILE).unlink(missing_ok=True)
                if tok is not None:
                    encode_as_trained(tok, tmp, score=model.head == "score")
            hf_config["dtype"] = _dtype_name(dtype)
            hf_config.pop("torch_dtype", None)
            (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
            if not (tmp / "generation_config.json").exists():
                _write_generation_config(tmp, hf_config)
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
    except BaseException:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    dist.barrier()
    return out


def encode_as_trained(tok, directory: Path, score: bool):
    """Make the tokenizer `tok`, copied into `directory`, encode as training did, so that a transformers or TRL user's plain
    `tokenizer(text)` gives what the model saw: [bos] text for a language model (its prompts; bos where
    the tokenizer has one) and [bos] text [eos] for a reward model (the sequences it scored). transformers'
    add_bos_token / add_eos_token set its post-processor and are saved with it; a tokenizer that already
    encodes so is left untouched."""
    from transformers import AutoTokenizer

    want = ([tok.bos_token_id] if tok.bos_token_id is not None else [], [tok.eos_token_id] if score else [])
    if not tok.is_fast or _specials_added(tok) == want:
        return
    tok.add_bos_token, tok.add_eos_token = bool(want[0]), score
    tok.save_pretrained(str(directory))
    if _specials_added(AutoTokenizer.from_pretrained(str(directory))) != want:
        raise ConfigError(f"the tokenizer exported to {directory} does not add {want} around a text as training did; "
                          f"report this with its tokenizer_config.json.")


def _specials_added(tok) -> tuple[list[int], list[int]]:
    """The ids a tokenizer puts before and after a text's own."""
    full, plain = tok("12")["input_ids"], tok("12", add_special_tokens=False)["input_ids"]
    start = next(i for i in range(len(full)) if full[i:i + len(plain)] == plain)
    return full[:start], full[start + len(plain):]


class _DtypeWriter:
    """Casts each tensor to the dtype it had in the imported checkpoint, else the export dtype."""

    def __init__(self, writer: ShardWriter, saved: dict):
        self.writer, self.saved = writer, saved

    def add(self, name: str, tensor: torch.Tensor, dtype: torch.dtype):
        self.writer.add(name, tensor.to(getattr(torch, self.saved[name]) if name in self.saved else dtype))

    def close(self):
        return self.writer.close()


def _dtype_name(dtype: torch.dtype) -> str:
    """HF's name of a dtype: torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def _config_dtype(hf_config: dict) -> torch.dtype | None:
    name = hf_config.get("dtype") or hf_config.get("torch_dtype")
    return getattr(torch, name) if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype) else None


def _write_generation_config(out: Path, hf_config: dict):
    gen = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf_config.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def staging_dir(out: Path) -> Path:
    """A temporary sibling of `out`, the same on every rank, renamed to `out` once complete."""
    holder = [str(out.parent / f".{out.name}.tmp-{os.getpid()}")]
    dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])
