"""Peak memory of one microbatch's log-probability forward and backward, whole logits against
data.logprob_chunk_tokens (training/chunked.py), on the CPU.

Each way runs in a fresh process: the output layer's input (tokens x hidden) and weight (vocabulary x
hidden) are made, then log p(labels) (megatron's vocab_parallel_cross_entropy on the whole fp32 logits,
or ChunkedLogits) and its backward into both. Reported: the peak resident memory above what the process
held before the forward (the weight, its input, the input's gradient and the weight's gradient buffer
excluded), in GB, and the ratio.

    python bench/logprob_memory.py [--vocab 151936] [--tokens 4096] [--hidden 1024] [--chunk 512]
"""

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


def measure(vocab: int, tokens: int, hidden: int, chunk: int) -> float:
    import torch

    from megatron_rl import platform

    platform.init_distributed()
    platform.init_model_parallel()
    from megatron_rl.training.logprobs import token_logprobs
    from megatron_rl.training.chunked import ChunkedLogits

    g = torch.Generator().manual_seed(0)
    h = (torch.randn(1, tokens, hidden, generator=g) * 0.1).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    # what training holds anyway, made resident before either way starts: the input's gradient, and the
    # weight's fp32 gradient buffer (megatron DDP's main_grad), into which the chunked backward accumulates;
    # the whole-logits backward makes its weight gradient as a new tensor (megatron's linear without
    # gradient-accumulation fusion, as on the CPU) which is added into it
    h.grad = torch.empty_like(h).fill_(0)
    w.main_grad = torch.empty_like(w).fill_(0)
    before = rss_peak_gb()
    logits = ChunkedLogits(h, w, chunk) if chunk else (h @ w.T)
    token_logprobs(logits, labels).sum().backward()
    return rss_peak_gb() - before


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--one", type=int, default=-1, help=argparse.SUPPRESS)  # a child: this chunk only
    args = parser.parse_args(argv)
    if args.one >= 0:
        print(json.dumps(measure(args.vocab, args.tokens, args.hidden, args.one)))
        return 0
    peaks = {}
    for name, chunk in (("whole", 0), ("chunked", args.chunk)):
        out = subprocess.run([sys.executable, __file__, "--vocab", str(args.vocab), "--tokens", str(args.tokens),
                              "--hidden", str(args.hidden), "--one", str(chunk)], cwd=ROOT, capture_output=True,
                             text=True, check=True)
        peaks[name] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"vocabulary {args.vocab}, {args.tokens} tokens, hidden {args.hidden}: peak memory of the logprob forward "
          f"and backward {peaks['whole']:.2f} GB whole, {peaks['chunked']:.2f} GB in chunks of {args.chunk} tokens "
          f"({peaks['chunked'] / peaks['whole']:.3f} of it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
