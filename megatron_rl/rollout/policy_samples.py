"""Samples of the starting policy, for data: the wrong answers a language model actually gives
(data.negatives' 'policy' kind), so that a reward model or DPO learns from on-policy mistakes."""

import torch.distributed as dist

from megatron_rl.config import Config, ConfigError


def wrong_answer_sampler(cfg: Config, tokenizer, samples_per_prompt: int = 4):
    """A function (prompts, answers) -> [a wrong completion, or None where every sample was right]
    that samples (rollout.* settings, seeded by data.seed) the language model of data.negatives_from
    (else checkpoint.load, else model.hf_path), built with its own architecture in this run's
    layout. Every rank calls it with the same prompts; each data-parallel rank samples its share.
    The model is built per call and freed after."""

    def sample(prompts: list[str], answers: list[str]) -> list[str | None]:
        from megatron.core import parallel_state as ps

        from megatron_rl.data.tokenizer import prompt_ids
        from megatron_rl.rollout.engine import RolloutEngine
        from megatron_rl.data.tokenizer import decode_texts
        from megatron_rl.training.frozen import load_frozen
        from megatron_rl.training.setup import compute_dtype

        def check(model, path, _):
            if model.head != "lm":
                raise ConfigError(f"{str(path)!r} is a reward model; the 'policy' negatives are sampled from a "
                                  f"language model: set data.negatives_from to one.")

        frozen = load_frozen(cfg, cfg.data.negatives_from or cfg.checkpoint.load or cfg.model.hf_path, check=check)
        chunks, model = frozen.chunks, frozen.model
        engine = RolloutEngine(chunks, model, tokenizer, cfg.rollout, compute_dtype(cfg))
        rank, size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        mine = prompts[rank::size]
        out = engine.generate(prompt_ids(tokenizer, mine), n=samples_per_prompt, seed=cfg.data.seed + rank)
        texts = [t.strip() for t in decode_texts(tokenizer, out.completions)]
        wrong = []
        for i, answer in enumerate(answers[rank::size]):
            group = texts[i * samples_per_prompt : (i + 1) * samples_per_prompt]
            wrong.append(next((t for t in group if t and t != str(answer).strip()), None))
        shares = [None] * size
        dist.all_gather_object(shares, wrong, group=ps.get_data_parallel_group())
        result = [None] * len(prompts)
        for r, share in enumerate(shares):
            result[r::size] = share
        return result

    return sample
