"""On-policy distillation: the student (the model being trained) samples completions with the rollout
engine; a frozen teacher of any size that shares its tokenizer reads the student's own sequences
and gives its top-k next-token distribution at every position; the student is trained on the
response tokens to match it (a KL on the top-k set: distill.kl_type; losses.distill_kl).

Per step: take prompts (this DP rank's share), roll out rollout.n completions each, run the
teacher forward on them (its top-k over the whole vocabulary under tensor parallelism:
training/logprobs.vocab_topk), then one optimizer step on the token mean of the KL over the global
batch. The teacher is built in the same SPMD program and parallel layout as the student.

With several teachers (distill.teachers, MOPD) each data row names its teacher; every token's
advantage is stop-gradient(log p_teacher - log p_student) of the sampled token (the student's from the
rollout), and the student takes the GRPO loop's policy-loss step on it (a sampled estimate of the
reverse KL to its teacher; clipping and mismatch correction as algorithm.* say).

With distill.cross_tokenizer the teacher has another tokenizer: each sample's response text is
tokenized by both, the tokens are grouped into chunks that end where both have a boundary
(data/alignment.py), and the student learns to match the teacher's log-likelihood of each chunk
(approximate likelihood matching: losses.chunk_likelihood_loss), a mean over the global batch's chunks.
"""

import math
from functools import partial
from pathlib import Path

import torch

from megatron_rl import losses
from megatron_rl.config import Config, ConfigError
from megatron_rl.data import rl as rl_data
from megatron_rl.data.alignment import chunk_sums
from megatron_rl.environments.rewards import build_scorer
from megatron_rl.rollout.engine import RolloutEngine, sampling_seed
from megatron_rl.rollout.evaluate import greedy_eval
from megatron_rl.training.logprobs import logprobs_at, mask_padded_vocab, token_logprobs, vocab_topk
from megatron_rl.training.policy import RLBatch, logprobs_of, one_update_per_batch, train_policy
from megatron_rl.training.run import Run, closing_all
from megatron_rl.training.setup import compute_dtype
from megatron_rl.training.stats import global_mean
from megatron_rl.training.step import (cp_sum, cp_sum_straight_through, first_cp_rank, forward_only, make_microbatches,
                                       put_tokens, schedule_metrics, train_step)


def build_teacher(cfg: Config, tokenizer, path: str, key: str = "distill.teacher"):
    """The frozen teacher at `path` (the setting `key` names it; training/frozen.Frozen), after checking
    that it is a language model with the student's tokenizer (any tokenizer with distill.cross_tokenizer)."""
    from megatron_rl.data.tokenizer import load_tokenizer, tokenizer_difference
    from megatron_rl.training.frozen import load_frozen

    if not Path(path).exists():
        raise ConfigError(f"{key}={path!r} does not exist; give our checkpoint or run directory, or a Hugging Face "
                          "directory.")

    def check(model, _, tokenizer_dir):
        if model.head != "lm":
            raise ConfigError(f"{key}={path!r} is a reward model; a teacher is a language model.")
        difference = tokenizer_difference(tokenizer, load_tokenizer(tokenizer_dir))
        if difference and not cfg.distill.cross_tokenizer:
            raise ConfigError(f"{key}={path!r} has another tokenizer than the student ({difference}); this "
                              "distillation compares the two models token by token: set distill.cross_tokenizer=true "
                              "to align them on the text instead.")

    return load_frozen(cfg, path, check=check)


def build_teachers(cfg: Config, tokenizer, train_meta: list[dict]) -> dict[str, list]:
    """name -> teacher chunks: distill.teachers, each row of the training data naming one of them; or
    distill.teacher under the name '' (after checking that distill.topk fits the vocabulary)."""
    d = cfg.distill
    if not d.teachers:
        if d.topk > len(tokenizer) and not d.cross_tokenizer:
            raise ConfigError(f"distill.topk={d.topk} exceeds the vocabulary ({len(tokenizer)} tokens); lower it.")
        return {"": build_teacher(cfg, tokenizer, d.teacher).chunks}
    for i, meta in enumerate(train_meta):
        if meta.get("teacher") not in d.teachers:
            raise ConfigError(f"training row {i + 1} names teacher {meta.get('teacher')!r}, which distill.teachers does "
                              f"not have ({', '.join(sorted(d.teachers))}); give every row a 'teacher' among them.")
    return {name: build_teacher(cfg, tokenizer, path, f"distill.teachers {name}").chunks
            for name, path in d.teachers.items()}


def teacher_advantages(teachers: dict[str, list], names: list[str], batch: RLBatch, cfg: Config, vocab: int) -> torch.Tensor:
    """MOPD: per token, stop-gradient(log p_teacher - log p_student) of the sampled token (N, S), each
    sample against the teacher its row names; the student's log-probs are the rollout's."""
    teacher_logp = torch.zeros_like(batch.loss_mask)
    for name, chunks in teachers.items():  # every teacher on every rank: the forwards are collective
        logp = logprobs_of(chunks, batch.tensors(), cfg, vocab=vocab)
        rows = torch.tensor([n == name for n in names])
        teacher_logp[rows] = logp[rows]
    return (teacher_logp - batch.rollout_logp) * batch.loss_mask


def masked_from(model, tokenizer) -> int:
    """Ids from here on are masked in a model (its ModelConfig): megatron's padded rows and ids the tokenizer
    never makes."""
    return min(len(tokenizer), model.vocab_size)


def teacher_topk(teacher: list, batch: dict, cfg: Config, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k ids at every position of the batch's sequences and its log-probs renormalized
    over them, (N, S, k) each (valid on the last pipeline stage)."""
    n, s, k = *batch["tokens"].shape, cfg.distill.topk
    ids, logp = torch.zeros(n, s, k, dtype=torch.long), torch.zeros(n, s, k)

    def collect(mb, logits):
        values, top = vocab_topk(mask_padded_vocab(logits, vocab), k)
        put_tokens(ids, mb, top)
        put_tokens(logp, mb, torch.log_softmax(values, dim=-1))

    micro = make_microbatches(cfg, {key: batch[key] for key in ("tokens", "labels", "loss_mask", "index")},
                              cfg.data.micro_batch_size)
    forward_only(teacher, micro, collect)
    return cp_sum(ids), cp_sum(logp)  # each context-parallel rank filled the positions it holds


def distill_loss(cfg: Config, vocab: int, batch: dict, logits: torch.Tensor):
    """(KL sum over the microbatch's response tokens, their count, report); megatron divides the
    summed numerators' gradients by the global count (a token mean over the global batch)."""
    d = cfg.distill
    mask = batch["loss_mask"]
    student, neg_entropy = logprobs_at(mask_padded_vocab(logits, vocab), batch["topk_ids"])
    mass = losses.masked_sum(student.detach().exp().sum(dim=-1), mask)
    if d.renormalize_student:
        student, neg_entropy = torch.log_softmax(student, dim=-1), None
    kl = losses.distill_kl(student, batch["topk_logp"], d.kl_type, d.mixed_kl_weight, neg_entropy)
    num = losses.masked_sum(kl, mask)
    return num, mask.sum().int(), {"loss_num": num.detach(), "tokens": mask.sum(), "topk_mass": mass}


def xtoken_loss(cfg: Config, vocab: int, batch: dict, logits: torch.Tensor):
    """Cross-tokenizer: (the ALM loss summed over the microbatch's chunks, their count, report). Each
    chunk's student log-likelihood is the sum of its tokens' log-probs; under context parallelism it is
    summed over the group straight through (every rank sees whole chunks, each rank's gradient reaches
    its own tokens), and the chunks count once per group."""
    mask, width = batch["loss_mask"], batch["chunk_valid"].shape[1]
    logp = token_logprobs(mask_padded_vocab(logits, vocab), batch["labels"]) * mask
    student = cp_sum_straight_through(chunk_sums(logp, batch["chunk"], width))
    valid = batch["chunk_valid"]
    loss = losses.chunk_likelihood_loss(student, batch["teacher_chunk_logp"], cfg.distill.chunk_temperature) * valid
    once = float(first_cp_rank())
    gap = losses.masked_sum((student - batch["teacher_chunk_logp"]).detach(), valid)
    return loss.sum(), (valid.sum() * once).int(), {"loss_num": loss.sum().detach() * once, "tokens": valid.sum() * once,
                                                    "gap": gap * once}


class CrossTokenizer:
    """The student's batch in its tokens and the teacher's chunk log-likelihoods, per step."""

    def __init__(self, cfg: Config, tokenizer, teacher):
        from megatron_rl.data.tokenizer import load_tokenizer

        self.cfg, self.tokenizer, self.teacher = cfg, tokenizer, teacher
        self.teacher_tokenizer = load_tokenizer(teacher.tokenizer_dir)
        self.teacher_vocab = masked_from(teacher.model, self.teacher_tokenizer)
        self.multiple = math.lcm(16, cfg.parallel.sequence_divisor())

    def batch(self, rollout) -> dict:
        from megatron_rl.data.alignment import cross_batches
        from megatron_rl.data.tokenizer import decode_texts

        eos = self.tokenizer.eos_token_id
        ended = [bool(c) and c[-1] == eos for c in rollout.completions]
        responses = decode_texts(self.tokenizer, rollout.completions)
        student, teacher = cross_batches(decode_texts(self.tokenizer, rollout.prompts), responses, ended, rollout.prompts,
                                         self.tokenizer, self.teacher_tokenizer, self.cfg.data.seq_length,
                                         self.multiple)
        teacher["index"] = torch.arange(len(responses))
        logp = logprobs_of(self.teacher.chunks, teacher, self.cfg, vocab=self.teacher_vocab)
        width = student["chunk_valid"].shape[1]
        student["teacher_chunk_logp"] = chunk_sums(logp * teacher["loss_mask"], teacher["chunk"], width)
        return student


def run(cfg: Config, run_dir: Path) -> dict:
    from megatron.core import parallel_state as ps

    r = cfg.rollout
    tokenizer, (train_prompts, train_meta), (val_prompts, val_meta) = rl_data.prompt_splits(cfg, run_dir)
    cross = CrossTokenizer(cfg, tokenizer, build_teacher(cfg, tokenizer, cfg.distill.teacher)) \
        if cfg.distill.cross_tokenizer else None
    teachers = build_teachers(cfg, tokenizer, train_meta) if cross is None else {}
    run = Run(cfg, run_dir, tokenizer, {"index": torch.arange(len(train_prompts))}, cfg.algorithm.prompts_per_step)
    engine = RolloutEngine(run.trainee.model, cfg.model, tokenizer, r, compute_dtype(cfg))
    val_scorer = build_scorer(cfg, cfg.rewards.val_fn or cfg.rewards.fn, tokenizer) if val_prompts else None
    vocab = masked_from(cfg.model, tokenizer)
    loss_fn = partial(xtoken_loss if cross else distill_loss, cfg, vocab)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

    def step() -> dict:
        with run.phase("rollout"):
            index = run.data.next()["index"].tolist()
            rollout = engine.generate([train_prompts[i] for i in index], n=r.n, seed=sampling_seed(r.seed, run.step, dp_rank))
        with run.phase("teacher"):
            if cross is not None:
                batch, gap = cross.batch(rollout), {}
            else:
                names = [train_meta[i].get("teacher", "") for i in index for _ in range(r.n)]
                batch, gap = teacher_batch(cfg, run.trainee, rollout, names, teachers, tokenizer.pad_token_id, vocab)
        with run.phase("train"):
            if cfg.distill.teachers:  # the policy loss of the GRPO family on the teachers' per-token advantages
                train = {**train_policy(run.trainee, cfg, batch)[0], **gap}
            else:
                train = train_student(cfg, run.trainee, batch, loss_fn, cross is not None)
        generated = sum(rollout.lengths)
        times = run.phase_times()
        return {**train, **global_mean({"rollout/response_len_mean": float(generated),
                                        "rollout/truncated_frac": float(sum(rollout.truncated))}, len(rollout.completions)),
                **times, "perf/rollout_tokens_per_s": generated * dp / times["perf/time_rollout_s"],
                **schedule_metrics(run.trainee)}

    def validate() -> dict:
        return greedy_eval(engine, val_scorer, tokenizer, val_prompts, val_meta)

    with closing_all(val_scorer):
        return run.loop(step, validate if val_prompts else None, plot=["train/loss", "val/accuracy"])


def teacher_batch(cfg: Config, trainee, rollout, names: list[str], teachers: dict, pad_id: int, vocab: int):
    """The rollout packed with what the student learns from, and its metrics: with several teachers each
    sample's per-token advantages against its teacher (and the old policy's logprobs when more than one
    optimizer step uses them), else the one teacher's top-k at every position."""
    batch = RLBatch.of(rollout, cfg.data.seq_length, pad_id, replay_filter=False)  # the student's full distribution
    if not cfg.distill.teachers:
        tensors = batch.tensors("tokens", "labels", "loss_mask", "index")
        tensors["topk_ids"], tensors["topk_logp"] = teacher_topk(teachers[""], tensors, cfg, vocab)
        return tensors, {}
    batch.advantages = teacher_advantages(teachers, names, batch, cfg, vocab)
    gap = global_mean({"distill/teacher_student_logprob_gap_mean": batch.advantages.sum().item()},
                      batch.loss_mask.sum().item())
    if not one_update_per_batch(cfg.algorithm):
        batch.old_logp = logprobs_of(trainee.model, batch.tensors(), cfg)
    return batch, gap


def train_student(cfg: Config, trainee, batch: dict, loss_fn, cross: bool) -> dict:
    """One optimizer step on the distillation loss (top-k KL, or cross-tokenizer chunk likelihoods)."""
    keys = ("tokens", "labels", "loss_mask",
            *(("chunk", "chunk_valid", "teacher_chunk_logp") if cross else ("topk_ids", "topk_logp")))
    micro = make_microbatches(cfg, {k: batch[k] for k in keys}, cfg.data.micro_batch_size)
    report, grad_norm = train_step(trainee, micro, loss_fn)
    tokens = max(report.get("tokens", 0.0), 1.0)  # (chunks, cross-tokenizer)
    out = {"train/loss": report.get("loss_num", 0.0) / tokens, "train/grad_norm": grad_norm}
    if cross:
        out["distill/chunk_logp_gap_mean"] = report.get("gap", 0.0) / tokens
    else:
        out["train/student_topk_mass"] = report.get("topk_mass", 0.0) / tokens
    return out
