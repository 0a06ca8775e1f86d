"""Generation throughput: our rollout engine (megatron-core's dynamic engine on the Megatron model)
against Hugging Face transformers' `generate` on the same weights, prompts, batch and sampling.

    python bench/rollout_throughput.py [--batch 64] [--new-tokens 64] [--size 25m]

Two settings, both sampling at temperature 1 from the same prompts:
- fixed: exactly --new-tokens tokens per sequence (end-of-sequence off): the same work for both.
- rl: end-of-sequence on, with its logit raised so that lengths vary as in RL rollouts (mean about
  a third of --new-tokens). transformers keeps finished sequences in the batch until the last one
  ends; our engine drops them, so they stop costing compute.
Each engine runs --repeats times, the two taking turns; the ratio is the median over pairs of
adjacent runs (this shared machine's speed drifts by up to 25% within minutes), the tokens/s of
each its fastest run. Also prints the GEMM-bound floor of this machine (2 x parameters x tokens
FLOPs at the measured fp32 matmul rate) as a fraction reached.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {  # Qwen3-shaped models
    "25m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64, vocab_size=8192),
    "tiny": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=1024),
}


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_dtype() -> torch.dtype:
    """Both engines compute in bf16 on a GPU, in fp32 on CPU."""
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def matmul_tflops(device: torch.device, dtype: torch.dtype = torch.float32, repeat: int = 20) -> float:
    """The device's GEMM rate in `dtype` (1024^3 products on CPU, 8192^3 on a GPU): the faster of
    torch.matmul and, on CPU in fp32, oneDNN's linear (which our linear layers use there; on AMD CPUs
    it beats MKL's sgemm)."""
    from megatron_rl.platform import cpu

    n = 8192 if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    gemms = [lambda: a @ b]
    if device.type == "cpu" and dtype == torch.float32 and cpu.has_onednn_linear():
        gemms.append(lambda: cpu.onednn_linear(a, b))
    best = 0.0
    for gemm in gemms:
        gemm()
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(repeat):
            gemm()
        synchronize(device)
        best = max(best, 2 * n**3 * repeat / (time.perf_counter() - t0) / 1e12)
    return best


def hf_generator(path, prompts, new_tokens, seed, stop_at_eos, device):
    """A function that runs transformers' generate once and returns (seconds, generated tokens)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=bench_dtype()).eval().to(device)
    ids = torch.tensor(prompts, device=device)
    eos = model.generation_config.eos_token_id

    def run():
        torch.manual_seed(seed)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=0 if stop_at_eos else new_tokens, do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0)
            synchronize(device)
            dt = time.perf_counter() - t0
        generated = out[:, ids.shape[1]:]
        if stop_at_eos:  # tokens up to and including each sequence's first eos
            ended = (generated == eos).int().cumsum(dim=1)
            return dt, int(((ended == 0) | ((ended == 1) & (generated == eos))).sum())
        return dt, generated.numel()

    return run


def our_generator(path, prompts, new_tokens, seed, stop_at_eos):
    """A function that runs our rollout engine once and returns (seconds, generated tokens)."""
    from megatron_rl.config import Config, RolloutConfig
    from megatron_rl.hf import import_hf, model_config_from_hf
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.training.setup import build_model
    from transformers import AutoTokenizer

    cfg = Config(model=model_config_from_hf(path))
    cfg.train.precision = "bf16" if bench_dtype() == torch.bfloat16 else "fp32"
    chunks, _ = build_model(cfg, wrap_ddp=False)
    import_hf(chunks, cfg.model, path)
    rollout = RolloutConfig(max_new_tokens=new_tokens, max_sequence_length=len(prompts[0]) + new_tokens + 8,
                            max_requests=len(prompts), temperature=1.0, kv_cache_gb=1.0)
    engine = RolloutEngine(chunks, cfg.model, AutoTokenizer.from_pretrained(str(path)), rollout, bench_dtype(),
                           stop_at_eos=stop_at_eos)

    def run():
        t0 = time.perf_counter()
        out = engine.generate(prompts, n=1, seed=seed)
        dt = time.perf_counter() - t0
        assert stop_at_eos or sum(out.lengths) == len(prompts) * new_tokens
        return dt, sum(out.lengths)

    return run


def paired_runs(ours, hf, repeats: int) -> tuple[list, list]:
    """Both engines `repeats` times after one warm-up run each, back to back in alternating order:
    this shared machine's speed drifts by up to 25% within minutes, so each pair of adjacent runs
    gives a ratio measured at one speed. Returns each engine's (seconds, tokens) per run."""
    ours(), hf()
    runs = {"ours": [], "hf": []}
    for i in range(repeats):
        for name, run in (("ours", ours), ("hf", hf)) if i % 2 == 0 else (("hf", hf), ("ours", ours)):
            runs[name].append(run())
    return runs["ours"], runs["hf"]


def raise_eos_logit(path: Path, eos: int, new_tokens: int):
    """Make end-of-sequence likely enough (about 3/new_tokens per step) that lengths vary."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    weights = load_file(str(file))
    head = weights["lm_head.weight"]
    probe = torch.randn(256, head.shape[1]) * 0.5
    logits = probe @ head.T  # typical logits; shift eos's by a constant so its probability is ~3/new_tokens
    target = torch.log(torch.tensor(3.0 / new_tokens)) + torch.logsumexp(logits, -1).mean() - logits[:, eos].mean()
    direction = head[eos] / head[eos].norm()
    weights["lm_head.weight"][eos] = head[eos] + direction * target / (probe @ direction).mean().clamp(min=1e-3)
    save_file(weights, str(file), metadata={"format": "pt"})


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--size", choices=sorted(SIZES), default="25m")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each engine, taking turns")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()

    import transformers

    from megatron_rl import platform
    from megatron_rl.data.tokenizer import build_char_tokenizer
    from tests.hf_models import randomize_

    platform.init_distributed()
    platform.init_model_parallel()
    tmp = Path(tempfile.mkdtemp())
    tok = build_char_tokenizer("0123456789abcdefghijklmnopqrstuvwxyz", tmp)
    config = transformers.Qwen3Config(**SIZES[args.size], bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize_(model)
    model.save_pretrained(str(tmp))
    params = sum(p.numel() for p in model.parameters())
    del model
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 36, (args.batch, args.prompt_len), generator=g).tolist()

    flops = matmul_tflops(platform.device(), bench_dtype())
    floor_tps = flops * 1e12 / (2 * params)
    result = {"model": f"Qwen3-shaped {params / 1e6:.1f}M params, {str(bench_dtype())[6:]}", "batch": args.batch, "repeats": args.repeats,
              "max_new_tokens": args.new_tokens, "threads": torch.get_num_threads(), "matmul_tflops": round(flops, 3),
              "floor_tokens_per_s": round(floor_tps, 1)}
    for setting, stop_at_eos in (("fixed", False), ("rl", True)):
        if stop_at_eos:
            raise_eos_logit(tmp, tok.eos_token_id, args.new_tokens)
        ours, hf = paired_runs(our_generator(tmp, prompts, args.new_tokens, 0, stop_at_eos),
                               hf_generator(tmp, prompts, args.new_tokens, 0, stop_at_eos, platform.device()),
                               args.repeats)
        ratios = sorted((t / s) / (ht / hs) for (s, t), (hs, ht) in zip(ours, hf))
        our_tps, hf_tps = (max(t / s for s, t in runs) for runs in (ours, hf))  # the fastest run of each
        result[setting] = {"ours_tokens_per_s": round(our_tps, 1), "hf_generate_tokens_per_s": round(hf_tps, 1),
                           "ours_over_hf": round(statistics.median(ratios), 2),
                           "ours_over_hf_range": [round(ratios[0], 2), round(ratios[-1], 2)],
                           "ours_tokens": ours[0][1], "hf_tokens": hf[0][1],
                           "ours_fraction_of_floor": round(our_tps / floor_tps, 2)}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    platform.shutdown()


if __name__ == "__main__":
    main()
