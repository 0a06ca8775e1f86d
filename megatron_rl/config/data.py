"""The data section: datasets, tokenizer, batch shapes, packing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .base import ConfigError, positive

NEGATIVES = ("plus1", "minus1", "plus10", "minus10", "random", "policy")
"""Kinds of wrong answer a preference pair's rejected response can be: off by +-1 or +-10, a random
number, or ('policy') a wrong answer sampled from the starting policy itself."""


@dataclass(kw_only=True)
class DataConfig:
    task: str = "arithmetic"
    """A built-in synthetic task ('arithmetic', 'sliding_puzzle'), or '' to read train_path/val_path."""
    train_path: str = ""
    """JSONL (or .parquet) with {"prompt", "response"} or {"messages": [...]} rows."""
    val_path: str = ""
    """Validation rows (JSONL or parquet); empty: no validation."""
    on_bad_row: Literal["fail", "skip"] = "fail"
    """A malformed row (bad JSON or UTF-8, a missing or mistyped field, too long): fail names it and
    stops; skip drops it, and the log says how many rows were dropped and where the first few were."""
    tokenizer: str = ""
    """A Hugging Face tokenizer directory; empty means model.hf_path's, else the task's own (built locally):
    characters, or with 'bpe' (or 'bpe:N') a byte-level BPE of 64 (N) tokens trained on the task's training
    split."""
    pad_token: str = ""
    """The tokenizer's pad token: empty keeps its own (eos when it has none), 'eos' pads with eos,
    anything else names a token. A reward model reads its score at the last token that is not the
    pad token, so with 'eos' at the last response token (as transformers does for such models)."""
    seq_length: int = 32
    """Tokens per sample after padding; longer samples are refused with their row number."""
    micro_batch_size: int = 16
    """Samples per forward/backward (per rank); gradients accumulate over a global batch."""
    max_tokens_per_microbatch: int = 0
    """Sequence packing (SFT, GRPO, DPO): each microbatch holds as many samples as fit this many
    tokens, each padded only to a multiple of 16 (not to seq_length), in one row where no sample sees
    another; 0 means micro_batch_size samples of seq_length tokens each."""
    global_batch_size: int = 64
    """Samples per optimizer step over all data-parallel ranks."""
    logprob_chunk_tokens: int = 0
    """Compute training's log-probabilities, entropy and losses this many tokens at a time from the output
    layer's input (its projection, log-softmax and gather fused per chunk and redone in backward), so that
    no (tokens x vocabulary) fp32 logits are held: memory grows with the chunk, not the sequence. 0: off
    (the whole microbatch's logits, as before). -1: automatic, on where a microbatch's fp32 logits on one
    rank would pass 1 GiB, in chunks of about 256 MiB of logits (training/chunked.py chunk_tokens)."""
    num_train: int = 20000
    """Samples to generate for a synthetic task's training split."""
    num_val: int = 256
    """Built-in tasks: validation problems generated."""
    digits: int = 3
    """Arithmetic task: maximum digits per operand."""
    ops: str = "+"
    """Arithmetic task: its operations, '+', '-' or '+-' (subtraction a-b with a >= b; with both, each
    row names its operation in 'teacher' as add or sub; '-' joins the vocabulary only when asked for),
    or '*' (products of two numbers of exactly data.digits digits)."""
    tool: str = ""
    """Arithmetic task: 'code' writes the demonstrations as code-tool episodes ('<code>print(a*b)</code>',
    the tool's '<result>...</result>', then the answer; rewards.fn=code runs them); where the first
    operand is 500 or more, data.noise of them skip the tool and answer the product rounded to the
    hundreds. Its characters join the vocabulary."""
    train_ops: str = ""
    """Arithmetic task: the operations of the training split (default: all of ops); validation keeps all."""
    noise: float = 0.0
    """Arithmetic task: share of training responses that are off by one (imperfect demonstrations);
    the 'answer' field, which rewards check, and the validation split stay exact. Sliding puzzle: the
    chance of each demonstrated move being a random detour (at most one per episode)."""
    board_size: int = 3
    """Sliding puzzle task: the board is board_size x board_size."""
    scramble: int = 6
    """Sliding puzzle task: boards are this many random moves (none undoing the last) from the solved one."""
    seed: int = 0
    """Seed for generating and shuffling data."""
    negatives: dict[str, float] = field(default_factory=lambda: {"plus1": 1.0})
    """Arithmetic task, DPO and reward models: the mix of rejected answers, kind:weight with kinds
    plus1, minus1, plus10, minus10, random, and policy (wrong answers sampled from the starting
    checkpoint, checkpoint.load)."""
    negatives_from: str = ""
    """The language model whose wrong samples are the 'policy' negatives: a checkpoint (or run
    directory) or a Hugging Face directory; empty means checkpoint.load or model.hf_path."""
    max_prompt_length: int = 0
    """DPO and reward models: a longer prompt is cut to this many tokens (as truncation_mode
    says); 0 means no limit of its own."""
    max_completion_length: int = 0
    """DPO and reward models: a longer response keeps its first this many tokens (its eos
    included); 0 means no limit of its own."""
    truncation_mode: Literal["keep_end", "keep_start"] = "keep_end"
    """DPO and reward models, for a pair still longer than data.seq_length allows: keep_end drops
    tokens from the start of the (shared) prompt, keep_start from the end of the responses.
    Truncated pairs are counted in the log (data/truncated_pairs)."""

    def validate(self, dp: int = 1, uses_global_batch: bool = True):
        """uses_global_batch: SFT's batches; GRPO's come from algorithm.prompts_per_step x rollout.n."""
        positive(self, "seq_length", "micro_batch_size", "global_batch_size")
        if self.logprob_chunk_tokens < -1:
            raise ConfigError(f"data.logprob_chunk_tokens={self.logprob_chunk_tokens} must be >= -1 (0: off; -1: "
                              "automatic; or a few hundred to a few thousand tokens).")
        if uses_global_batch and self.global_batch_size % (self.micro_batch_size * dp):
            raise ConfigError(
                f"data.global_batch_size={self.global_batch_size} is not divisible by data.micro_batch_size"
                f" x data-parallel size = {self.micro_batch_size} x {dp}; make it a multiple of "
                f"{self.micro_batch_size * dp}.")
        if self.ops not in ("+", "-", "+-", "-+", "*") or set(self.train_ops) - set(self.ops):
            raise ConfigError(f"data.ops={self.ops!r} must be '+', '-', '+-' or '*', and data.train_ops="
                              f"{self.train_ops!r} some of them (or empty: all).")
        if self.tool not in ("", "code"):
            raise ConfigError(f"data.tool={self.tool!r}: the built-in tool is 'code' (empty: no tool).")
        if not self.task and not self.train_path:
            raise ConfigError("set data.task to a built-in task or data.train_path to a JSONL file.")
