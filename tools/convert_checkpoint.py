"""Convert between Hugging Face model directories and megatron-rl (dist_checkpointing) checkpoints.

    python tools/convert_checkpoint.py import --hf HF_DIR --out MEGATRON_DIR [--tp N --pp N --ep N]
    python tools/convert_checkpoint.py export --megatron MEGATRON_DIR_OR_RUN_DIR --out HF_DIR [--dtype bf16]
    python tools/convert_checkpoint.py export --megatron LORA_RUN_CHECKPOINT --out HF_DIR --merge-lora
    python tools/convert_checkpoint.py export --megatron LORA_RUN_CHECKPOINT --out PEFT_DIR --adapter-only
    torchrun --nproc_per_node 4 tools/convert_checkpoint.py import --hf HF_DIR --out DIR --tp 2 --pp 2

Tensors stream one at a time: each rank reads (import) or gathers and writes (export) only its own
shard of the model, so no rank ever holds the whole model. The output appears only when complete.
Megatron checkpoints reshard on load, so the layout used here need not match training's.
"""

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face -> megatron-rl checkpoint")
    imp.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    imp.add_argument("--allow-pickle", action="store_true",
                     help="also read pickled pytorch_model*.bin weights (only from sources you trust)")
    exp = sub.add_parser("export", help="megatron-rl checkpoint -> Hugging Face")
    exp.add_argument("--megatron", required=True, help="a megatron-rl checkpoint (checkpoints/step_N or an import), "
                     "or a run directory (its latest complete checkpoint)")
    exp.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                     help="tensor dtype (default: each tensor's dtype when imported, else the HF config's)")
    exp.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB or 500MB")
    lora = exp.add_mutually_exclusive_group()
    lora.add_argument("--merge-lora", action="store_true",
                      help="a LoRA checkpoint: HF weights with the adapters merged, W + (alpha / rank) B A")
    lora.add_argument("--adapter-only", action="store_true",
                      help="a LoRA checkpoint: its adapters alone, as a PEFT directory for the base's HF export")
    for sp in (imp, exp):
        sp.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
        sp.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
        sp.add_argument("--tp", type=int, default=1, help="tensor parallel size of this conversion run")
        sp.add_argument("--pp", type=int, default=1, help="pipeline parallel size of this conversion run")
        sp.add_argument("--ep", type=int, default=1, help="expert parallel size of this conversion run")
    return p.parse_args(argv)


def parse_size(text: str) -> int:
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40, "B": 1}
    for unit, scale in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_rl import checkpointing, platform
    from megatron_rl.config import Config, ConfigError, LoRAConfig, ParallelConfig
    from megatron_rl.hf import DTYPES, export_hf, import_hf, model_config_from_hf, staging_dir, write_assets
    from megatron_rl.training.setup import build_model

    out = Path(args.out)
    try:
        launch = platform.read_launch()
        if out.exists() and not args.overwrite:
            raise ConfigError(f"{str(out)!r} already exists; choose another --out or pass --overwrite.")
        if args.command == "import":
            model = model_config_from_hf(args.hf)
        else:
            source = checkpointing.resolve(args.megatron)  # a run directory: its latest complete checkpoint
            model = checkpointing.read_model_config(source)
        cfg = Config(model=model, parallel=ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep))
        cfg.algorithm.name = "rm" if model.head == "score" else "sft"  # the model's own kind, checked as trained
        cfg.train.precision = "fp32"  # conversions are exact: bf16/fp16 weights fit fp32 losslessly
        if args.command == "export":
            lora = checkpointing.saved_lora(source)
            if lora and not (args.merge_lora or args.adapter_only):
                raise ConfigError(f"{args.megatron!r} holds LoRA adapters: export with --merge-lora (HF weights with "
                                  f"them merged) or --adapter-only (a PEFT directory).")
            if not lora and (args.merge_lora or args.adapter_only):
                raise ConfigError(f"{args.megatron!r} holds no LoRA adapters; export it without --merge-lora or "
                                  f"--adapter-only.")
            if lora:
                cfg.lora = LoRAConfig(rank=lora["rank"], alpha=lora["alpha"], targets=tuple(lora["targets"]))
        cfg.validate(world_size=launch.world_size)
    except (ConfigError, FileNotFoundError, platform.LaunchError) as e:
        if isinstance(e, platform.LaunchError) or launch.rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2

    platform.init_distributed(launch)
    p = cfg.parallel
    platform.init_model_parallel(tp=p.tp, pp=p.pp, ep=p.ep)
    chunks, _ = build_model(cfg, wrap_ddp=False, adapters=True)
    try:
        if args.command == "import":
            import_hf(chunks, model, args.hf, allow_pickle=args.allow_pickle)
            tmp = staging_dir(out)
            checkpointing.save_weights(chunks, tmp, model)
            if launch.rank == 0:
                write_assets(args.hf, tmp / checkpointing.ASSETS, allow_pickle=args.allow_pickle)
                if out.exists():
                    shutil.rmtree(out)
                os.replace(tmp, out)
        else:
            if args.adapter_only:
                from megatron_rl.hf.peft import export_peft
                checkpointing.load_weights(chunks, source, model.head, cfg.lora)
                export_peft(chunks, model, cfg.lora, out, overwrite=args.overwrite)
            else:  # a LoRA checkpoint: its base (checked), then its adapters merged into it, as training loads it
                from megatron_rl.training.setup import load_base
                load_base(chunks, cfg, str(source))
                export_hf(chunks, model, out, assets=source / checkpointing.ASSETS,
                          dtype=DTYPES.get(args.dtype), max_shard_bytes=parse_size(args.max_shard_size),
                          overwrite=args.overwrite)
    except ConfigError as e:
        if launch.rank == 0:
            print(f"error: {e}", file=sys.stderr)
        platform.shutdown()
        return 2
    if launch.rank == 0:
        print(f"wrote {out}")
    platform.shutdown()
    return 0


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import this module
    sys.exit(main())
