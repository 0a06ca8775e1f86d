"""Log-probabilities without the (tokens x vocabulary) fp32 logits (data.logprob_chunk_tokens > 0).

With chunking on, a training model's output layer returns `ChunkedLogits`, its input and weight, instead
of the logits; training/logprobs.py computes from them chunk by chunk of tokens: the output projection,
the vocabulary-parallel log-softmax and the label's gather fused per chunk, and recomputed per chunk in the
backward. Peak memory then grows with the chunk, not the sequence (a Qwen-size 151,936-token vocabulary
at 16k tokens is about 10 GB of fp32 logits per sequence per TP shard). The numbers are megatron's
vocab_parallel_cross_entropy's: fp32 logits, the max and the sum of exponentials all-reduced over the
tensor-parallel ranks, each holding a slice of the vocabulary. Inference (the rollout engine, which asks
the output layer for gathered logits) keeps the plain output layer.
"""

import functools
import types

import torch


AUTO_ON_BYTES, AUTO_CHUNK_BYTES = 1 << 30, 256 << 20  # data.logprob_chunk_tokens=-1


def chunk_tokens(cfg) -> int:
    """The tokens of a chunk (0: no chunking) for data.logprob_chunk_tokens; -1 (automatic) chunks where a
    microbatch's fp32 logits on one rank (its tokens / CP x vocabulary / TP) would pass 1 GiB, in chunks
    of about 256 MiB of logits (a multiple of 64 tokens)."""
    d, p, m = cfg.data, cfg.parallel, cfg.model
    if d.logprob_chunk_tokens != -1:
        return d.logprob_chunk_tokens
    row = 4 * -(-m.vocab_size // p.tp)  # one token's fp32 logits on a rank
    tokens = (d.max_tokens_per_microbatch or d.micro_batch_size * d.seq_length) // p.cp
    if tokens * row <= AUTO_ON_BYTES:
        return 0
    return max(64, AUTO_CHUNK_BYTES // row // 64 * 64)


def padding_start(vocab_size: int, shard: int) -> int | None:
    """Where megatron's padded vocabulary (ids >= vocab_size) starts in this tensor-parallel rank's shard of
    `shard` entries, or None where the shard has none."""
    from megatron.core import parallel_state as ps

    first = vocab_size - ps.get_tensor_model_parallel_rank() * shard
    return max(first, 0) if first < shard else None


class ChunkedLogits:
    """A last stage's output in place of its logits: hidden (B, S, H) and the output layer's weight
    (V/tp, H), in `chunk` tokens at a time; `vocab_size` masks the padded vocabulary (mask_padded_vocab).
    Only what the loss functions and the model's own post-processing ask of logits is here."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, chunk: int, vocab_size: int | None = None):
        self.hidden, self.weight, self.chunk, self.vocab_size = hidden, weight, chunk, vocab_size

    def _with(self, hidden=None, weight=None, vocab_size=None) -> "ChunkedLogits":
        return ChunkedLogits(self.hidden if hidden is None else hidden, self.weight if weight is None else weight,
                             self.chunk, self.vocab_size if vocab_size is None else vocab_size)

    def transpose(self, a: int, b: int) -> "ChunkedLogits":  # megatron's [s b h] => [b s h]
        return self._with(hidden=self.hidden.transpose(a, b))

    def contiguous(self) -> "ChunkedLogits":
        return self

    def detach(self) -> "ChunkedLogits":
        return self._with(hidden=self.hidden.detach(), weight=self.weight.detach())

    def map_hidden(self, fn) -> "ChunkedLogits":
        """The same logits of other tokens: fn applied to the hidden states (B, S, H) -> (B', S', H)."""
        return self._with(hidden=fn(self.hidden))

    def masked(self, vocab_size: int) -> "ChunkedLogits":
        return self._with(vocab_size=vocab_size)

    @functools.cached_property
    def flat(self) -> torch.Tensor:
        """The hidden states of every token, (B x S, H): made once (a copy, from the model's transposed view)."""
        return self.hidden.reshape(-1, self.hidden.shape[-1])

    def logits(self, rows: slice) -> torch.Tensor:
        """fp32 vocab-parallel logits (n, V/tp) of the flattened tokens `rows`, the padded vocabulary -inf."""
        out = (self.flat[rows] @ self.weight.T).float()
        pad = padding_start(self.vocab_size, out.shape[-1]) if self.vocab_size else None
        if pad is not None:  # a fresh tensor: masked in place
            out[:, pad:] = float("-inf")
        return out

    def rows(self):
        n = len(self.flat)
        return [slice(s, min(s + self.chunk, n)) for s in range(0, n, self.chunk)]


def _tp():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    return (ps.get_tensor_model_parallel_group() if tp > 1 else None), ps.get_tensor_model_parallel_rank(), dist


def _picked(logits: torch.Tensor, ids: torch.Tensor, shard_start: int):
    """(the logits at ids (n, k) on this shard, 0 elsewhere; whether this shard holds each; its local ids)
    of fp32 logits (n, V/tp)."""
    local = ids - shard_start
    mine = (local >= 0) & (local < logits.shape[-1])
    local = local.clamp(0, logits.shape[-1] - 1)
    return torch.where(mine, logits.gather(-1, local), 0.0), mine, local


def outside_kept(logits: torch.Tensor, ids: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Where vocab-parallel logits (..., V/tp) fall outside a sampler's kept set: below threshold (...,),
    except at ids (..., k), which are always kept (the sampled token, whose logit may round to just below
    it in training)."""
    from megatron.core import parallel_state as ps

    shard = logits.shape[-1]
    _, mine, local = _picked(logits, ids, ps.get_tensor_model_parallel_rank() * shard)
    below = logits < threshold[..., None]
    return below.scatter_(-1, local, below.gather(-1, local) & ~mine)


class _LogProbsAt(torch.autograd.Function):
    """From ChunkedLogits: log p at ids (n, k) per token and, with `entropy`, sum_v p_v log p_v (n,), in
    fp32 over the whole (vocab-parallel) vocabulary; with a threshold (n,), over a sampler's kept set
    (outside_kept). Forward keeps one chunk's logits at a time and each token's max and log-normalizer;
    backward recomputes each chunk's logits and softmax."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, source: ChunkedLogits, entropy: bool, threshold=None):
        group, rank, dist = _tp()
        ctx.set_materialize_grads(False)
        c = source._with(hidden=hidden, weight=weight)
        ids = ids.reshape(-1, ids.shape[-1])
        threshold = None if threshold is None else threshold.reshape(-1)
        n = len(ids)
        out = torch.empty(ids.shape, dtype=torch.float32, device=hidden.device)
        top, log_z, neg_entropy = (torch.zeros(n, device=hidden.device) for _ in range(3))
        for rows in c.rows():
            logits = _kept_logits(c, rows, ids, threshold)
            picked, _, _ = _picked(logits, ids[rows], rank * logits.shape[-1])
            top[rows] = logits.max(dim=-1).values
            if group is not None:
                dist.all_reduce(top[rows], op=dist.ReduceOp.MAX, group=group)
            shifted = logits.sub_(top[rows, None])
            e = shifted.exp() if entropy else shifted.exp_()  # entropy needs the shifted logits too
            stats = [e.sum(dim=-1), picked] + ([(e * shifted.masked_fill(e == 0, 0.0)).sum(dim=-1)] if entropy else [])
            del logits, shifted, e  # one chunk's logits at a time
            if group is not None:
                for t in stats:
                    dist.all_reduce(t, group=group)
            log_z[rows] = stats[0].log()
            out[rows] = stats[1] - top[rows, None] - log_z[rows, None]
            if entropy:
                neg_entropy[rows] = stats[2] / stats[0] - log_z[rows]
        ctx.save_for_backward(hidden, weight, ids, top + log_z, neg_entropy)
        ctx.source, ctx.threshold = source, threshold
        return out.view(*hidden.shape[:-1], -1), neg_entropy.view(hidden.shape[:-1])

    @staticmethod
    def backward(ctx, grad_at, grad_entropy):
        hidden, weight, ids, lse, neg_entropy = ctx.saved_tensors
        _, rank, _ = _tp()
        c = ctx.source._with(hidden=hidden, weight=weight)
        flat = c.flat
        grad_at = None if grad_at is None else grad_at.reshape(ids.shape).float()
        grad_entropy = None if grad_entropy is None else grad_entropy.reshape(-1).float()
        # the weight's gradient goes straight into megatron's fp32 gradient buffer where it has one (as its
        # gradient-accumulation fusion does): no (vocabulary x hidden) tensor is made
        main_grad = getattr(weight, "main_grad", None)
        grad_hidden = torch.empty_like(flat)
        grad_weight = main_grad if main_grad is not None else torch.zeros_like(weight, dtype=torch.float32)
        for rows in c.rows():
            logp = _kept_logits(c, rows, ids, ctx.threshold).sub_(lse[rows, None])
            # d log p_i / d logit_v = [v = i] - p_v;  d sum_u p_u log p_u / d logit_v = p_v (log p_v - that sum);
            # in place, so that a chunk holds two (vocabulary-wide) buffers at most
            if grad_entropy is not None:
                p = logp.exp()
                d = logp.sub_(neg_entropy[rows, None]).mul_(p).masked_fill_(p == 0, 0.0).mul_(grad_entropy[rows, None])
            else:
                p, d = logp.exp_(), None
            if grad_at is not None:
                _, mine, local = _picked(p, ids[rows], rank * p.shape[-1])
                p.mul_(-grad_at[rows].sum(dim=-1, keepdim=True))
                d = p if d is None else d.add_(p)
                d.scatter_add_(1, local, torch.where(mine, grad_at[rows], 0.0))
            del logp, p
            d = d.to(weight.dtype)
            grad_hidden[rows] = d @ weight
            grad_weight.addmm_(d.T.float(), flat[rows].float())
            del d
        # in the hidden states' own memory order (a transposed view of the model's [s b h]): megatron's
        # tensor-parallel all-reduce of this gradient (_CopyToModelParallelRegion's backward) reduces a
        # contiguous copy of a non-contiguous gradient and drops it
        grad_hidden = torch.empty_like(hidden).copy_(grad_hidden.view(hidden.shape))
        return grad_hidden, None if main_grad is not None else grad_weight.to(weight.dtype), None, None, None, None


def _kept_logits(c: ChunkedLogits, rows: slice, ids: torch.Tensor, threshold: torch.Tensor | None) -> torch.Tensor:
    """A chunk's logits, -inf outside the sampler's kept set where there is one."""
    logits = c.logits(rows)
    if threshold is None:
        return logits
    return logits.masked_fill_(outside_kept(logits, ids[rows], threshold[rows]), float("-inf"))


def token_logprobs(c: ChunkedLogits, labels: torch.Tensor, threshold: torch.Tensor | None = None) -> torch.Tensor:
    """(B, S) fp32 log p(labels), differentiable in the hidden states and the output weight; threshold:
    logprobs.token_logprobs'."""
    return _LogProbsAt.apply(c.hidden, c.weight, labels[..., None], c, False, threshold)[0][..., 0]


def logprobs_at(c: ChunkedLogits, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S, k) fp32 log-probs at ids and (B, S) sum_v p_v log p_v, differentiable (logprobs.logprobs_at)."""
    return _LogProbsAt.apply(c.hidden, c.weight, ids, c, True)


@torch.no_grad()
def by_chunk(fn, c: ChunkedLogits, *per_token: torch.Tensor) -> torch.Tensor:
    """fn(chunk's logits (n, V/tp), each of per_token's (B, S) tensors' chunk) for every chunk: (B, S)."""
    flat = [t.reshape(-1) for t in per_token]
    return torch.cat([fn(c.logits(rows), *(t[rows] for t in flat)) for rows in c.rows()]).view(c.hidden.shape[:-1])


def install(chunks: list, chunk_tokens: int) -> None:
    """Training forwards of these model chunks' output layers (the last stage's) return ChunkedLogits;
    a forward that asks for gathered logits (the rollout engine's) gets them as before. The input is
    made whole and TP-ready as the output layer's own forward makes it: gathered along the sequence
    under sequence parallelism (its backward reduce-scatters), else copied (its backward all-reduces)."""
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_sequence_parallel_region)

    from model_providers.builder import unwrap

    def chunked_forward(layer, input_, weight=None, runtime_gather_output=None):
        if runtime_gather_output:
            return type(layer).forward(layer, input_, weight=weight, runtime_gather_output=runtime_gather_output)
        if layer.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True)
        else:
            hidden = copy_to_tensor_model_parallel_region(input_)
        return ChunkedLogits(hidden, layer.weight if weight is None else weight, chunk_tokens), None

    for chunk in chunks:
        layer = getattr(unwrap(chunk), "output_layer", None)
        if layer is not None:
            layer.forward = types.MethodType(chunked_forward, layer)
