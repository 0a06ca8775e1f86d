"""PPO's critic: a GPTModel with the reward model's scalar head (model_providers/heads.py) read at every
position, trained by its own optimizer in the same SPMD program and parallel layout as the policy.

Alignment: the value at position t is the critic's output at t, the state (tokens 0..t) from which the
policy chose labels[t] = tokens[t + 1]; the policy's logprob of that token sits at the same t. The
critic is saved beside the policy, under <run_dir>/critic/checkpoints/step_N, before the policy's
checkpoint of that step, so a resumed policy always finds its critic.
"""

import copy
import dataclasses
from pathlib import Path

import torch

from megatron_rl import checkpointing, losses
from megatron_rl.config import Config, ConfigError
from megatron_rl.training.step import cp_sum, forward_only, make_microbatches, put_tokens, share_with_pipeline


def critic_config(cfg: Config) -> Config:
    """The policy's config with a score head, the critic's learning rate, and the critic's start
    (ppo.critic, else the policy's) as its only weights source."""
    c = copy.deepcopy(cfg)
    c.model.head = "score"
    if cfg.ppo.critic_lr:
        ratio = cfg.ppo.critic_lr / cfg.optimizer.lr
        c.optimizer.lr, c.optimizer.min_lr = cfg.ppo.critic_lr, cfg.optimizer.min_lr * ratio
    source = cfg.ppo.critic or cfg.checkpoint.load or cfg.model.hf_path
    c.checkpoint.resume, c.checkpoint.load, c.model.hf_path = False, "", ""
    if source and checkpointing.is_ours(source):
        c.checkpoint.load = source
    elif source:
        c.model.hf_path = source
    return c


def _check_architecture(cfg: Config, critic: Config):
    """A ppo.critic of another architecture than the policy's, refused in one sentence."""
    from megatron_rl.hf import model_config_from_hf

    if not cfg.ppo.critic:
        return
    if not Path(cfg.ppo.critic).exists():
        raise ConfigError(f"ppo.critic={cfg.ppo.critic!r} does not exist; point it at our checkpoint or run "
                          "directory, or a Hugging Face directory, or leave it empty to start from the policy.")
    if critic.checkpoint.load:
        path = checkpointing.resolve(critic.checkpoint.load)
        saved = dataclasses.asdict(checkpointing.read_model_config(path))
    else:
        saved = dataclasses.asdict(model_config_from_hf(critic.model.hf_path))
    diff = checkpointing.architecture_diff(saved, cfg.model)
    if diff:
        raise ConfigError(f"ppo.critic={cfg.ppo.critic!r} holds a model of another architecture than the policy "
                          f"(model.{', model.'.join(diff[:3])}); the critic is built like the policy: point ppo.critic "
                          "to a checkpoint of the policy's architecture, or leave it empty to start from the policy.")


def build_critic(cfg: Config, run_dir: Path, resumed_step: int | None):
    """The critic's Trainee, its weights from ppo.critic (or the policy's start), or at resume from
    its checkpoint of the policy's step."""
    from megatron_rl.training.setup import build_trainee, load_initial_state

    c = critic_config(cfg)
    _check_architecture(cfg, c)
    critic = build_trainee(c)
    if resumed_step is not None:
        checkpointing.load(critic, checkpointing.checkpoint_dir(critic_dir(run_dir), resumed_step))
    else:
        load_initial_state(critic, c, critic_dir(run_dir))
    return critic, c


def critic_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "critic"


def values_of(model_chunks: list, batch: dict, cfg: Config) -> torch.Tensor:
    """The critic's values (N, S) of batch["tokens"] at every position, whole sequences (gathered over
    context parallelism) on every rank of the model-parallel group."""
    out = torch.zeros_like(batch["loss_mask"])

    def collect(mb, values):
        put_tokens(out, mb, values.float())

    micro = make_microbatches(cfg, {k: batch[k] for k in ("tokens", "loss_mask", "index")}, cfg.data.micro_batch_size)
    forward_only(model_chunks, micro, collect)
    return share_with_pipeline(cp_sum(out))


def critic_loss(clip: float, batch: dict, values: torch.Tensor):
    """(loss numerator, tokens, report) for a microbatch: the clipped value loss summed over response
    tokens; megatron divides by the global token count. The report has what explained variance needs."""
    mask = batch["loss_mask"]
    v = values.float()
    loss, clipped = losses.value_loss(v, batch["old_values"], batch["returns"], clip)
    ret, err = batch["returns"].detach(), (batch["returns"] - v).detach()
    report = {"value_loss": losses.masked_sum(loss, mask).detach(), "value_clipped": losses.masked_sum(clipped.float(), mask),
              "value_tokens": mask.sum(), "return_sum": losses.masked_sum(ret, mask),
              "return_sq": losses.masked_sum(ret**2, mask), "error_sum": losses.masked_sum(err, mask),
              "error_sq": losses.masked_sum(err**2, mask)}
    return losses.masked_sum(loss, mask), mask.sum().int(), report


def critic_metrics(sums: dict, grad_norms: list[float]) -> dict:
    """train/value_loss, value_clip_frac, explained_variance (1 - Var(R - V) / Var(R) over the
    response tokens of the global batch, before each update) and critic_grad_norm."""
    n = max(sums["value_tokens"], 1.0)

    def var(s, sq):
        return max(sums[sq] / n - (sums[s] / n) ** 2, 0.0)

    returns_var = var("return_sum", "return_sq")
    return {"train/value_loss": sums["value_loss"] / n, "train/value_clip_frac": sums["value_clipped"] / n,
            "train/explained_variance": 1 - var("error_sum", "error_sq") / returns_var if returns_var > 0 else 0.0,
            "train/critic_grad_norm": sum(grad_norms) / len(grad_norms)}
