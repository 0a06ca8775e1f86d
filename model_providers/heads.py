"""The scalar head of reward models: a GPTModel whose last stage maps each position's hidden state to
one number instead of vocabulary logits.

The head is a plain (hidden -> 1) weight, replicated over tensor-parallel ranks and computed in
fp32. With sequence parallelism each rank scores its own slice of the sequence and the scores
are gathered (the backward takes each rank's slice back, no reduction); the weight, which then
sees only its rank's tokens, is marked `sequence_parallel` so that megatron's gradient
finalization sums its gradient over the TP group. Embeddings are never tied to it.
"""

import torch
import torch.nn.functional as F

HEAD_SEED = 0
"""A fresh head is drawn from this seed, so it is the same at every parallel layout."""


class ScalarHead(torch.nn.Module):
    def __init__(self, hidden_size: int, std: float, sequence_parallel: bool, dtype: torch.dtype):
        super().__init__()
        g = torch.Generator().manual_seed(HEAD_SEED)
        self.weight = torch.nn.Parameter((torch.randn(1, hidden_size, generator=g) * std).to(dtype))
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (s, b, h), s this rank's share under sequence parallelism -> scores (s_full, b) fp32."""
        scores = F.linear(hidden.float(), self.weight.float()).squeeze(-1)
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            scores = gather_from_sequence_parallel_region(scores, tensor_parallel_output_grad=False)
        return scores


def score_model_class():
    """GPTModel with the scalar head in place of the output layer (built lazily: megatron imports)."""
    from megatron.core.models.gpt import GPTModel

    class ScoreModel(GPTModel):
        """forward(...) returns (b, s) fp32 scores on the last pipeline stage, hidden states elsewhere."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, share_embeddings_and_output_weights=False, **kwargs)
            if self.post_process:
                del self.output_layer
                c = self.config
                self.score_head = ScalarHead(c.hidden_size, c.init_method_std, c.sequence_parallel, c.params_dtype)

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
            # LanguageModule's version handles the (absent) output layer; MegatronModule's covers the rest,
            # the head as a tensor replicated over TP.
            from megatron.core.transformer.module import MegatronModule
            from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

            return MegatronModule.sharded_state_dict(self, prefix, sharded_offsets,
                                                     ensure_metadata_has_dp_cp_group(metadata))

        def _postprocess(self, hidden_states, **_unused):
            if not self.post_process:
                return hidden_states
            return self.score_head(hidden_states).transpose(0, 1).contiguous()

    return ScoreModel


def score_positions(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Where a sequence's score is read, as transformers' *ForSequenceClassification reads it: the
    rightmost token that is not the pad token (so with pad == eos, the token before a final eos).
    tokens (B, S) -> (B,) positions."""
    not_pad = (tokens != pad_id).long()
    return (torch.arange(tokens.shape[-1], device=tokens.device) * not_pad).argmax(-1)


def starts_fresh(source_head: str, head: str, source: str) -> bool:
    """Whether a model with `head` loading weights saved with `source_head` keeps its own, fresh
    scalar head (a reward model started from a language model); refuses a language model
    started from a reward model."""
    from megatron_rl.config import ConfigError

    if source_head == head:
        return False
    if head == "lm":
        raise ConfigError(f"{source} holds a reward model (a scalar score head, no vocabulary output), but this run "
                          f"trains a language model; start from a language-model checkpoint (a reward model serves "
                          f"GRPO as rewards.model).")
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"note: {source} is a language model: its output layer is dropped and the score head starts fresh.",
              flush=True)
    return True


def scores_at(scores: torch.Tensor, batch: dict) -> torch.Tensor:
    """Each row's score at batch["score_pos"] from a score model's output (B, S_local) at this
    context-parallel rank's batch["positions"]: (B,), zero where another rank holds the position."""
    hit = batch["positions"][None, :] == batch["score_pos"][:, None]
    return (scores * hit).sum(dim=1)
