"""GRPO: group-relative policy optimization with rollouts from megatron-core's inference engine.

Per step: take prompts (this DP rank's share), roll out rollout.n completions each on the training
model, score them, turn rewards into group advantages, recompute the sampled tokens' logprobs with
the training forward (the old policy; also the reference's when algorithm.kl_coef > 0), then
algorithm.epochs x algorithm.minibatches optimizer steps on the clipped policy-gradient loss.
The loss is a token-level mean over the global batch: megatron divides by the global token count.

Left out here (see the issues): DAPO/GSPO/... variants, dynamic sampling, value models.
"""

import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl import checkpointing, losses
from megatron_rl.config import Config
from megatron_rl.data import rl as rl_data
from megatron_rl.data.sft import Batches, microbatches, read_jsonl
from megatron_rl.data.tasks import data_files
from megatron_rl.hf import export_hf
from megatron_rl.logging import RunLogger, plot_metrics
from megatron_rl.profiling import Profiler
from megatron_rl.rewards import RewardRunner
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.training.logprobs import entropy, mask_padded_vocab, token_logprobs
from megatron_rl.training.setup import build_model, build_trainee, compute_dtype, load_initial_state, write_run_assets
from megatron_rl.training.step import forward_backward, optimizer_step, reduce_reports, zero_grads


def grpo_loss(cfg: Config, batch: dict, logits: torch.Tensor):
    """(sum of per-token losses, token count, report) for one microbatch."""
    a = cfg.algorithm
    logits = mask_padded_vocab(logits, cfg.model.vocab_size)  # (B, S, V/tp)
    mask = batch["loss_mask"]
    entropy_sum = losses.masked_sum(entropy(logits), mask)  # before token_logprobs overwrites the logits
    logp = token_logprobs(logits, batch["labels"])  # (B, S)
    loss, clipped = losses.clipped_policy_loss(logp, batch["old_logp"], batch["advantages"], a.clip_low, a.clip_high)
    report = {"clipped": losses.masked_sum(clipped.float(), mask).detach()}
    if a.kl_coef:
        kl = losses.kl_penalty(logp, batch["ref_logp"], a.kl_estimator)
        loss = loss + a.kl_coef * kl
        report["kl_sum"] = losses.masked_sum(kl, mask).detach()
    loss_sum, tokens = losses.masked_sum(loss, mask), mask.sum()
    report.update(loss_sum=loss_sum.detach(), tokens=tokens, entropy_sum=entropy_sum)
    return loss_sum, tokens.int(), report


def logprobs_of(model_chunks: list, batch: dict, micro_batch_size: int, vocab_size: int) -> torch.Tensor:
    """Per-token logprobs of the labels (N, S) under `model_chunks`, from the training forward
    (valid on the last pipeline stage; zeros elsewhere)."""
    from types import SimpleNamespace

    out = torch.zeros_like(batch["loss_mask"])

    def capture(mb, logits):
        out[mb["index"]] = token_logprobs(mask_padded_vocab(logits, vocab_size), mb["labels"]).float()
        return logits.sum() * 0, torch.tensor(1), {}

    micro = microbatches({k: batch[k] for k in ("tokens", "labels", "index")}, micro_batch_size)
    with torch.no_grad():
        forward_backward(SimpleNamespace(model=model_chunks), micro, capture, forward_only=True)
    return out


def score(runner, tokenizer, prompts, rollout, metadata, n) -> tuple[torch.Tensor, object]:
    """Rewards (N,) of a rollout; sample i*n + j answers prompt i."""
    texts = [tokenizer.decode(p, skip_special_tokens=True) for p in prompts]
    completions = [tokenizer.decode(c, skip_special_tokens=True) for c in rollout.completions]
    scores = runner.score([texts[i // n] for i in range(len(completions))], completions,
                          [metadata[i // n] for i in range(len(completions))])
    return torch.tensor(scores.rewards, dtype=torch.float), scores


def global_mean(values: dict[str, float], count: float) -> dict[str, float]:
    """Sums over data-parallel ranks divided by the global count."""
    from megatron.core import parallel_state as ps

    t = torch.tensor([*values.values(), count], dtype=torch.float64)
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return {k: v / max(t[-1].item(), 1) for k, v in zip(values, t[:-1].tolist())}


def evaluate(engine, runner, tokenizer, prompts, metadata) -> dict:
    """Greedy decoding of the held-out prompts (this DP rank's share): val/accuracy, val/reward_mean."""
    from megatron.core import parallel_state as ps

    rank, size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mine = list(range(rank, len(prompts), size))
    rollout = engine.generate([prompts[i] for i in mine], n=1, greedy=True)
    rewards, _ = score(runner, tokenizer, [prompts[i] for i in mine], rollout, [metadata[i] for i in mine], 1)
    return global_mean({"val/reward_mean": rewards.sum().item(), "val/accuracy": (rewards >= 1).sum().item()},
                       len(mine))


def run(cfg: Config, run_dir: Path) -> dict:
    from megatron.core import parallel_state as ps

    a, r = cfg.algorithm, cfg.rollout
    tokenizer, train_path, val_path = data_files(cfg, run_dir)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = len(tokenizer)
    train_prompts, train_meta = rl_data.encode_prompts(read_jsonl(train_path), tokenizer, str(train_path))
    val_prompts, val_meta = rl_data.encode_prompts(read_jsonl(val_path), tokenizer, str(val_path)) if val_path else ([], [])
    trainee = build_trainee(cfg)
    assets = write_run_assets(cfg, run_dir, tokenizer)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    stream = Batches({"index": torch.arange(len(train_prompts))}, a.prompts_per_step, cfg.data.seed, dp_rank, dp)
    latest, state = load_initial_state(trainee, cfg, run_dir)
    step = state["step"] if state else 0
    if state:
        stream.load_state_dict(state["extra"]["data"])
    reference = None
    if a.kl_coef:  # the frozen initial policy
        reference, _ = build_model(cfg, wrap_ddp=False)
        for ref, chunk in zip(reference, trainee.model):
            ref.load_state_dict(checkpointing.unwrap(chunk).state_dict())
            ref.eval()
    engine = RolloutEngine(trainee.model, cfg.model, tokenizer, r, compute_dtype(cfg))
    runner = RewardRunner(cfg.rewards.fn, cfg.rewards.timeout_s, cfg.rewards.workers)
    log = RunLogger(run_dir, cfg.train.max_steps, step, enabled=dist.get_rank() == 0,
                    tensorboard=cfg.logging.tensorboard, progress=cfg.logging.progress, desc=cfg.recipe or "grpo")
    if latest is not None:
        log.write(f"resumed from {latest} at step {step}")
    prof = Profiler(cfg.profiling.nvtx, cfg.profiling.nsys_start, cfg.profiling.nsys_end)
    if step == 0 and val_prompts:  # the starting point, logged as step 0
        log.log(0, evaluate(engine, runner, tokenizer, val_prompts, val_meta))

    metrics = {}
    while step < cfg.train.max_steps:
        prof.step(step)
        times = {}
        t0 = time.perf_counter()
        with prof.range("rollout"):
            index = stream.next()["index"].tolist()
            prompts, meta = [train_prompts[i] for i in index], [train_meta[i] for i in index]
            rollout = engine.generate(prompts, n=r.n, seed=r.seed + step * 7919 + dp_rank)
            rewards, scores = score(runner, tokenizer, prompts, rollout, meta, r.n)
            advantages = losses.group_advantages(rewards, r.n, a.baseline, a.std_normalization)
        times["perf/time_rollout_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        with prof.range("logprob"):
            batch = rl_data.pack(rollout.prompts, rollout.completions, cfg.data.seq_length, tokenizer.pad_token_id,
                                 rollout_logp=rollout.logprobs)
            batch.update(index=torch.arange(len(rewards)), advantages=advantages)
            batch["old_logp"] = logprobs_of(trainee.model, batch, cfg.data.micro_batch_size, cfg.model.vocab_size)
            if reference is not None:
                batch["ref_logp"] = logprobs_of(reference, batch, cfg.data.micro_batch_size, cfg.model.vocab_size)
            mismatch = mismatch_stats(batch)
        times["perf/time_logprob_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        with prof.range("train"):
            train_metrics = train_on(trainee, cfg, batch)
        times["perf/time_train_s"] = time.perf_counter() - t0
        step += 1

        n_local = len(rewards)
        generated = sum(rollout.lengths)
        metrics = {
            **global_mean({"rollout/reward_mean": rewards.sum().item(), "rollout/accuracy": (rewards >= 1).sum().item(),
                           "rollout/response_len_mean": float(generated),
                           "rollout/truncated_frac": float(sum(rollout.truncated)),
                           "rollout/reward_failure_frac": float(scores.failures)}, n_local),
            **mismatch, **train_metrics, **times,
            "perf/rollout_tokens_per_s": generated * dp / times["perf/time_rollout_s"],
            "perf/train_tokens_per_s": batch["loss_mask"].sum().item() * dp * a.epochs / times["perf/time_train_s"],
            "train/lr": trainee.scheduler.get_lr(trainee.optimizer.param_groups[0]),
        }
        if scores.failures:
            log.write(f"warning: step {step}: {scores.failures} samples got reward 0 because scoring failed "
                      f"({'; '.join(scores.errors)})")
        is_last = step == cfg.train.max_steps
        if val_prompts and (is_last or (cfg.train.eval_every and step % cfg.train.eval_every == 0)):
            with prof.range("eval"):
                metrics.update(evaluate(engine, runner, tokenizer, val_prompts, val_meta))
        log.log(step, metrics)
        if cfg.checkpoint.save and (is_last or (cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0)):
            checkpointing.save(trainee, run_dir, step, {"data": stream.state_dict()}, cfg.checkpoint.keep,
                               model=cfg.model, assets=assets)
    runner.close()
    if cfg.checkpoint.export_hf:
        log.write(f"wrote {export_hf(trainee.model, cfg.model, run_dir / 'hf', assets=assets, overwrite=True)}")
    if dist.get_rank() == 0:
        log.write(f"plot: {plot_metrics(run_dir, ['rollout/reward_mean', 'val/accuracy'])}")
    log.close()
    return log.last if dist.get_rank() == 0 else metrics


def mismatch_stats(batch: dict) -> dict:
    """How far the rollout's logprobs are from the training forward's, over generated tokens."""
    from megatron.core import parallel_state as ps

    mask = batch["loss_mask"] > 0
    diff = (batch["old_logp"] - batch["rollout_logp"]).abs()[mask]
    stats = torch.tensor([diff.max().item() if diff.numel() else 0.0, diff.sum().item(), float(diff.numel())],
                         dtype=torch.float64)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        stats.zero_()  # only the last stage computed logprobs
    top = stats[:1].clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    dist.all_reduce(stats)
    return {"rollout/logprob_mismatch_max": top.item(), "rollout/logprob_mismatch_mean": (stats[1] / stats[2].clamp(min=1)).item()}


def train_on(trainee, cfg: Config, batch: dict) -> dict:
    """algorithm.epochs passes of algorithm.minibatches optimizer steps over this rank's batch."""
    a = cfg.algorithm
    n = len(batch["tokens"])
    per_minibatch = n // a.minibatches
    loss_fn = partial(grpo_loss, cfg)
    keys = ["tokens", "labels", "loss_mask", "old_logp", "advantages", *(["ref_logp"] if a.kl_coef else [])]
    sums, grad_norms = {}, []
    order = torch.arange(n)
    for epoch in range(a.epochs):
        if epoch:  # reshuffle samples between epochs, the same way on every rank of a DP replica
            order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch))
        for m in range(a.minibatches):
            idx = order[m * per_minibatch : (m + 1) * per_minibatch]
            zero_grads(trainee)
            micro = microbatches({k: batch[k][idx] for k in keys}, cfg.data.micro_batch_size)
            report = reduce_reports(forward_backward(trainee, micro, loss_fn))
            _, grad_norm = optimizer_step(trainee)
            grad_norms.append(grad_norm)
            for k, v in report.items():
                sums[k] = sums.get(k, 0.0) + v
    tokens = max(sums.get("tokens", 0.0), 1.0)
    out = {"train/loss": sums.get("loss_sum", 0.0) / tokens, "train/clip_frac": sums.get("clipped", 0.0) / tokens,
           "train/entropy": sums.get("entropy_sum", 0.0) / tokens, "train/grad_norm": sum(grad_norms) / len(grad_norms)}
    out["train/kl"] = sums.get("kl_sum", 0.0) / tokens
    return out
