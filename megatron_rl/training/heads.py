"""Scoring whole sequences with a score model (model_providers/heads.py: the scalar head): reward models
as GRPO's reward, and their tests."""

import torch

from model_providers.heads import score_positions, scores_at


def score_sequences(model_chunks: list, tokens: torch.Tensor, pad_id: int, micro_batch_size: int) -> torch.Tensor:
    """A score model's scores (N,) of whole sequences (N, S) (right-padded with pad_id), read where
    transformers reads them; on every rank (all ranks of the model-parallel group call this)."""
    from megatron_rl.data.batches import microbatches
    from megatron_rl.training.step import cp_sum, forward_only, share_with_pipeline

    out = torch.zeros(len(tokens))

    def collect(mb, scores):
        out[mb["index"]] = scores_at(scores.float(), mb).cpu()

    batch = {"tokens": tokens, "score_pos": score_positions(tokens, pad_id), "index": torch.arange(len(tokens))}
    forward_only(model_chunks, microbatches(batch, micro_batch_size), collect)
    return share_with_pipeline(cp_sum(out))
