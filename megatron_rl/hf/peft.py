"""LoRA adapters to and from a PEFT adapter directory (adapter_config.json, adapter_model.safetensors).

Our adapters are PEFT's, one per HF projection (megatron_rl/training/lora.py): the q, k and v adapters of
megatron's fused linear_qkv are PEFT's q_proj, k_proj and v_proj ones, gate and up those of gate_proj and
up_proj, and so on, named by the family's weight rules (the HF names the base weight is made of, in order).
A is (rank, in) and B (out, rank) in both, so the tensors move over unchanged: the export is exact both ways.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.config import ConfigError, LoRAConfig, ModelConfig

PREFIX = "base_model.model."  # PEFT's name for the wrapped model


def _slices(model_chunks: list, model: ModelConfig):
    """(adapters module, chunk, local prefix of the adapters, {slice: HF module name}) of this rank."""
    from model_providers import get_family
    from model_providers.mapping import rules_for

    from megatron_rl.hf.weights import canonical
    from model_providers.builder import ADAPTERS, unwrap

    rules = [r for r in get_family(model.family).weight_rules(model) if r.kind != "expert"]
    for chunk in model_chunks:
        inner = unwrap(chunk)
        for local, mod in inner.named_modules():
            if not local.endswith(ADAPTERS):  # a layer's adapters (training/lora.py Adapters)
                continue
            base = inner.get_submodule(local.removesuffix(ADAPTERS))
            name, _ = canonical(local.removesuffix(ADAPTERS) + ".weight", base.weight, chunk, model)
            found = rules_for(rules, name)
            hf = [n.removesuffix(".weight") for n in found[0][0].hf_names(found[0][1])] if found else []
            if len(hf) != len(mod.a):
                raise ConfigError(f"the {model.family} converter has no per-projection HF names for {name!r}, so its "
                                  f"adapters have no PEFT form; leave it out of lora.targets.")
            yield mod, chunk, local, dict(zip(mod.a, hf))


def export_peft(model_chunks: list, model: ModelConfig, lora: LoRAConfig, out: str | Path, base: str = "",
                overwrite: bool = False) -> Path:
    """Write the adapters of every rank as a PEFT directory (all ranks call this; rank 0 writes)."""
    from safetensors.torch import save_file

    from megatron_rl.hf.weights import canonical

    out = Path(out)
    tensors = {}
    for mod, chunk, local, hf in _slices(model_chunks, model):
        for side, key in (("a", "lora_A"), ("b", "lora_B")):
            for s, linear in getattr(mod, side).items():
                _, place = canonical(f"{local}.{side}.{s}.weight", linear.weight, chunk, model)
                full = place.gather(linear.weight.detach()).float().contiguous()
                tensors[f"{PREFIX}{hf[s]}.{key}.weight"] = full
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, tensors)
    if dist.get_rank() == 0:
        merged = {k: v for d in every for k, v in d.items()}
        modules = sorted({k[len(PREFIX):].rsplit(".lora_", 1)[0] for k in merged})
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
                  "lora_dropout": lora.dropout, "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
                  "use_rslora": False, "use_dora": False, "init_lora_weights": True,
                  "base_model_name_or_path": base or None, "modules_to_save": None}
        tmp = out.with_name(f".{out.name}.partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(merged, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        if out.exists() and overwrite:
            shutil.rmtree(out)
        os.replace(tmp, out)
    dist.barrier()
    return out


def import_peft(model_chunks: list, model: ModelConfig, lora: LoRAConfig, path: str | Path):
    """Set this rank's adapters from a PEFT directory made for this architecture (its rank and alpha must
    be lora.rank and lora.alpha, and it must hold an adapter for every projection lora.targets names)."""
    from safetensors.torch import load_file

    from megatron_rl.hf.weights import canonical

    path = Path(path)
    config_file = path / "adapter_config.json"
    if not config_file.is_file() or not (path / "adapter_model.safetensors").is_file():
        raise ConfigError(f"lora.adapter={str(path)!r} is not a PEFT adapter directory (adapter_config.json and "
                          f"adapter_model.safetensors).")
    config = json.loads(config_file.read_text())
    if config.get("peft_type") != "LORA" or config.get("use_rslora") or config.get("use_dora"):
        raise ConfigError(f"lora.adapter={str(path)!r} is not a plain LoRA adapter (peft_type LORA without rsLoRA or "
                          f"DoRA).")
    if config.get("r") != lora.rank or float(config.get("lora_alpha", 0)) != lora.alpha:
        raise ConfigError(f"lora.adapter={str(path)!r} has rank {config.get('r')} and alpha {config.get('lora_alpha')}; "
                          f"set lora.rank={config.get('r')} lora.alpha={config.get('lora_alpha')}.")
    saved = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
             for k, v in load_file(str(path / "adapter_model.safetensors")).items()}
    used, problem = set(), None
    with torch.no_grad():
        for mod, chunk, local, hf in _slices(model_chunks, model):
            for side, key in (("a", "lora_A"), ("b", "lora_B")):
                for s, linear in getattr(mod, side).items():
                    name = f"{PREFIX}{hf[s]}.{key}.weight"
                    _, place = canonical(f"{local}.{side}.{s}.weight", linear.weight, chunk, model)
                    full_shape = list(linear.weight.shape)
                    if place.dim is not None:
                        full_shape[place.dim] *= place.size
                    if name not in saved or list(saved[name].shape) != full_shape:
                        problem = problem or (f"{name} is {'missing' if name not in saved else tuple(saved[name].shape)}"
                                              f" where this model needs {tuple(full_shape)}")
                        continue
                    linear.weight.copy_(place.slice(saved[name]).to(linear.weight.dtype))
                    used.add(name)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (sorted(used), problem))
    problems = [p for _, p in every if p]
    unused = sorted(set(saved) - {n for u, _ in every for n in u})
    if problems or unused:
        detail = problems[0] if problems else f"it has {unused[0]}, which no adapter of this model takes"
        raise ConfigError(f"lora.adapter={str(path)!r} does not fit this model and lora.targets: {detail}; use an "
                          f"adapter made for this architecture with the same targets.")
