"""Whether this machine can run the settings asked for, before any process group starts: FP8 in
Transformer Engine's own words (its probes check_fp8_support, check_fp8_block_scaling_support and
check_mxfp8_support know the hardware, CUDA and cuBLAS each recipe needs; no compute-capability
rules of ours), the optimizer's bf16 state and CPU offload (GPU-only in megatron-core), and the
batch-invariant kernels (Triton)."""

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


def check_support(cfg) -> None:
    """Raise a one-sentence ConfigError when a setting of `cfg` cannot run on this machine."""
    check_fp8(cfg.fp8)
    check_optimizer(cfg.optimizer)
    check_rollout(cfg.rollout)


def check_rollout(rollout) -> None:
    """rollout.batch_invariant runs megatron-core's Triton kernels, which need CUDA."""
    import importlib.util

    import torch

    if rollout.batch_invariant and not (torch.cuda.is_available() and importlib.util.find_spec("triton")):
        raise ConfigError("rollout.batch_invariant=true needs a GPU with Triton (megatron-core's batch-invariant "
                          "kernels are Triton kernels); on the CPU rollout and training logprobs already agree "
                          "to 1e-5: set rollout.batch_invariant=false.")


def check_optimizer(optimizer) -> None:
    """optimizer.state_dtype=bf16 runs on Transformer Engine's FusedAdam; optimizer.cpu_offload moves
    state between GPU and host on CUDA streams. Neither exists on a CPU-only machine, and megatron-core
    0.16.1 asks for Transformer Engine's version on both paths."""
    import importlib.util

    import torch

    what = optimizer.precision_aware_setting()
    if not what:
        return
    if not torch.cuda.is_available():
        raise ConfigError(f"{what} needs a GPU (megatron-core keeps the optimizer state in GPU memory, which it "
                          "shrinks or moves to the host); on the CPU the state is in host memory already: set "
                          "optimizer.state_dtype=fp32 and optimizer.cpu_offload=0.")
    if importlib.util.find_spec("transformer_engine") is None:  # megatron-core 0.16.1 fails without it
        raise ConfigError(f"{what} runs on megatron-core's precision-aware optimizer, which needs Transformer Engine: "
                          "pip install -e \".[gpu]\" (or use the container), or set optimizer.state_dtype=fp32 and "
                          "optimizer.cpu_offload=0.")


def check_fp8(fp8) -> None:
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
