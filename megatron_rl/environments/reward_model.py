"""A trained reward model as GRPO's reward (rewards.fn=reward_model, rewards.model=PATH).

The model (our checkpoint of an algorithm.name=rm run, or a Hugging Face *ForSequenceClassification
directory) is built frozen in the same SPMD program, in the policy's parallel layout, and scores
each batch of completions collectively: every rank of a model-parallel group calls `score` with the
same samples (they hold the same rollouts). A sequence is scored as the reward model was trained
on it, [bos] prompt completion [eos] in its own tokenizer: the policy's token ids when the two
tokenizers are the same, else the text re-tokenized.
"""

from pathlib import Path

import torch

from megatron_rl.config import Config, ConfigError

from megatron_rl.environments import Scores


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers turn text into the same ids and share their special tokens and chat template."""
    from megatron_rl.data.tokenizer import tokenizer_difference

    return tokenizer_difference(a, b) is None and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)


class RewardModel:
    def __init__(self, cfg: Config, path: str, policy_tokenizer):
        from megatron_rl.data.tokenizer import load_tokenizer
        from megatron_rl.training.frozen import load_frozen

        if not Path(path).exists():
            raise ConfigError(f"rewards.model={str(path)!r} does not exist; give a reward model's checkpoint or run "
                              f"directory, or a Hugging Face *ForSequenceClassification directory.")

        def check(model, path, _):
            if model.head != "score":
                raise ConfigError(f"rewards.model={str(path)!r} is a language model, not a reward model; train one "
                                  f"with algorithm.name=rm or give a Hugging Face *ForSequenceClassification directory.")

        frozen = load_frozen(cfg, path, head="score", check=check)
        self.chunks, tokenizer_dir = frozen.chunks, frozen.tokenizer_dir
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.same = same_tokenizer(self.tokenizer, policy_tokenizer)
        self.micro_batch_size, self.multiple = cfg.data.micro_batch_size, cfg.parallel.sequence_divisor()

    def sequences(self, prompts: list[str], completions: list[str], ids) -> list[list[int]]:
        from megatron_rl.data.tokenizer import prompt_ids

        eos = self.tokenizer.eos_token_id
        if self.same and ids is not None:
            return [list(p) + (c[:-1] if c[-1:] == [eos] else list(c)) + [eos] for p, c in zip(*ids)]
        responses = self.tokenizer(completions, add_special_tokens=False)["input_ids"]
        return [p + r + [eos] for p, r in zip(prompt_ids(self.tokenizer, prompts), responses)]

    def score(self, prompts: list[str], completions: list[str], metadata: list[dict], ids=None) -> Scores:
        from megatron_rl.training.heads import score_sequences

        seqs = self.sequences(prompts, completions, ids)
        length = -(-max(map(len, seqs)) // self.multiple) * self.multiple
        pad = self.tokenizer.pad_token_id
        tokens = torch.full((len(seqs), length), pad, dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = torch.tensor(s)
        return Scores(score_sequences(self.chunks, tokens, pad, self.micro_batch_size).tolist())

    def close(self):
        pass
