"""On-policy distillation: the student (the model being trained) samples completions with the rollout
engine; a frozen teacher of any size that shares its tokenizer reads the student's own sequences
and gives its top-k next-token distribution at every position; the student is trained on the
response tokens to match it (a KL on the top-k set: distill.kl_type; losses.distill_kl).

Per step: take prompts (this DP rank's share), roll out rollout.n completions each, run the
teacher forward on them (its top-k over the whole vocabulary under tensor parallelism:
training/logprobs.vocab_topk), then one optimizer step on the token mean of the KL over the global
batch. The teacher is built in the same SPMD program and parallel layout as the student.

Left out here: several teachers (MOPD), teachers with another tokenizer.
"""

import time
from functools import partial
from pathlib import Path

import torch

from megatron_rl import losses
from megatron_rl.config import Config, ConfigError
from megatron_rl.data import rl as rl_data
from megatron_rl.data.sft import Batches
from megatron_rl.rewards import build_scorer
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.evaluate import greedy_eval
from megatron_rl.training.logprobs import logprobs_at, mask_padded_vocab, vocab_topk
from megatron_rl.training.loop import due, finish, save_if_due, schedule_metrics, start_log, train_step
from megatron_rl.training.setup import build_trainee, compute_dtype, load_initial_state, write_run_assets
from megatron_rl.training.step import cp_sum, forward_only, global_mean, make_microbatches, put_tokens


def build_teacher(cfg: Config, tokenizer):
    """The frozen teacher of distill.teacher, after checking that it is a language model with the
    student's tokenizer and that distill.topk fits the vocabulary."""
    from megatron_rl.data.tokenizer import load_tokenizer, tokenizer_difference
    from megatron_rl.training.frozen import load_frozen

    d = cfg.distill
    if not Path(d.teacher).exists():
        raise ConfigError(f"distill.teacher={d.teacher!r} does not exist; give our checkpoint or run directory, or a "
                          "Hugging Face directory.")
    if d.topk > len(tokenizer):
        raise ConfigError(f"distill.topk={d.topk} exceeds the vocabulary ({len(tokenizer)} tokens); lower it.")

    def check(model, path, tokenizer_dir):
        if model.head != "lm":
            raise ConfigError(f"distill.teacher={d.teacher!r} is a reward model; a teacher is a language model.")
        difference = tokenizer_difference(tokenizer, load_tokenizer(tokenizer_dir))
        if difference:
            raise ConfigError(f"distill.teacher={d.teacher!r} has another tokenizer than the student ({difference}); "
                              "this distillation compares the two models token by token and needs one tokenizer "
                              "(cross-tokenizer distillation is not built yet).")

    frozen = load_frozen(cfg, d.teacher, check=check)
    return frozen.chunks


def vocabulary(cfg: Config, tokenizer) -> int:
    """Ids from here on are masked in both models: megatron's padded rows and ids the tokenizer never makes."""
    return min(len(tokenizer), cfg.model.vocab_size)


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


def run(cfg: Config, run_dir: Path) -> dict:
    from megatron.core import parallel_state as ps

    a, r = cfg.algorithm, cfg.rollout
    tokenizer, (train_prompts, _), (val_prompts, val_meta) = rl_data.prompt_splits(cfg, run_dir)
    teacher = build_teacher(cfg, tokenizer)
    trainee = build_trainee(cfg)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    stream = Batches({"index": torch.arange(len(train_prompts))}, a.prompts_per_step, cfg.data.seed, dp_rank, dp)
    latest, state = load_initial_state(trainee, cfg, run_dir)
    assets = write_run_assets(cfg, run_dir, tokenizer)
    step = state["step"] if state else 0
    if state:
        stream.load_state_dict(state["extra"]["data"])
    engine = RolloutEngine(trainee.model, cfg.model, tokenizer, r, compute_dtype(cfg))
    val_scorer = build_scorer(cfg, cfg.rewards.val_fn or cfg.rewards.fn, tokenizer) if val_prompts else None
    vocab = vocabulary(cfg, tokenizer)
    loss_fn = partial(distill_loss, cfg, vocab)
    log, prof = start_log(cfg, run_dir, step, latest)
    if step == 0 and val_prompts:  # the starting point, logged as step 0
        log.log(0, greedy_eval(engine, val_scorer, tokenizer, val_prompts, val_meta))

    metrics = {}
    while step < cfg.train.max_steps:
        prof.step(step)
        times = {}
        t0 = time.perf_counter()
        with prof.range("rollout"):
            prompts = [train_prompts[i] for i in stream.next()["index"].tolist()]
            rollout = engine.generate(prompts, n=r.n, seed=r.seed + step * 7919 + dp_rank)
        times["perf/time_rollout_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        with prof.range("teacher"):
            batch = rl_data.pack(rollout.prompts, rollout.completions, cfg.data.seq_length, tokenizer.pad_token_id,
                                 rollout_logp=rollout.logprobs)
            batch["index"] = torch.arange(len(rollout.completions))
            batch["topk_ids"], batch["topk_logp"] = teacher_topk(teacher, batch, cfg, vocab)
        times["perf/time_teacher_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        with prof.range("train"):
            keys = ("tokens", "labels", "loss_mask", "topk_ids", "topk_logp")
            micro = make_microbatches(cfg, {k: batch[k] for k in keys}, cfg.data.micro_batch_size)
            report, grad_norm = train_step(trainee, micro, loss_fn)
        times["perf/time_train_s"] = time.perf_counter() - t0
        step += 1

        tokens = max(report.get("tokens", 0.0), 1.0)
        generated = sum(rollout.lengths)
        metrics = {
            "train/loss": report.get("loss_num", 0.0) / tokens, "train/grad_norm": grad_norm,
            "train/student_topk_mass": report.get("topk_mass", 0.0) / tokens,
            **global_mean({"rollout/response_len_mean": float(generated),
                           "rollout/truncated_frac": float(sum(rollout.truncated))}, len(rollout.completions)),
            **times, "perf/rollout_tokens_per_s": generated * dp / times["perf/time_rollout_s"],
            **schedule_metrics(trainee),
        }
        is_last = step == cfg.train.max_steps
        if val_prompts and due(step, cfg.train.eval_every, is_last):
            with prof.range("eval"):
                metrics.update(greedy_eval(engine, val_scorer, tokenizer, val_prompts, val_meta))
        log.log(step, metrics)
        if save_if_due(cfg, trainee, run_dir, step, is_last, stream.state_dict(), assets, log):
            break
    if val_scorer is not None:
        val_scorer.close()
    return finish(cfg, trainee, run_dir, assets, log, prof, metrics, plot=["train/loss", "val/accuracy"])
