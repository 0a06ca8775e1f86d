"""Whether this machine can run the FP8 settings asked for, in Transformer Engine's own words: its
probes (check_fp8_support, check_fp8_block_scaling_support, check_mxfp8_support) know the
hardware, CUDA and cuBLAS each recipe needs; no compute-capability rules of ours."""

from megatron_rl.config import ConfigError

PROBES = {"delayed": "check_fp8_support", "tensorwise": "check_fp8_support",
          "blockwise": "check_fp8_block_scaling_support", "mxfp8": "check_mxfp8_support"}


def _probe(name: str):
    """TE's probe function: transformer_engine.pytorch.fp8 (TE 2.x) or .quantization (newer)."""
    import importlib

    for module in ("transformer_engine.pytorch.fp8", "transformer_engine.pytorch.quantization"):
        try:
            fn = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if fn is not None:
            return fn
    return None


def check_support(fp8) -> None:
    """Raise a one-sentence ConfigError when fp8 (an FP8Config) cannot run here."""
    if fp8.format == "off":
        return
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        raise ConfigError(f"fp8.format={fp8.format} needs Transformer Engine and a GPU: pip install -e \".[gpu]\" "
                          "on a CUDA machine (or use the container), or set fp8.format=off.") from None
    probe = _probe(PROBES[fp8.recipe])
    if probe is None:
        raise ConfigError(f"this Transformer Engine has no {PROBES[fp8.recipe]}: fp8.recipe={fp8.recipe} needs a newer "
                          "one (megatron-core 0.16.1 supports transformer-engine>=2.9,<2.12).")
    ok, reason = probe()
    if not ok:
        others = [r for r in ("tensorwise", "blockwise", "mxfp8") if r != fp8.recipe and (p := _probe(PROBES[r]))
                  and p()[0]]
        hint = f"use fp8.recipe={' or '.join(others)}" if others else "set fp8.format=off (bf16)"
        raise ConfigError(f"fp8.recipe={fp8.recipe} cannot run on this machine ({str(reason).rstrip('.')}): {hint}.")
