"""Disaggregated rollouts (parallel.rollout_ranks = R > 0): the job's last R ranks only generate, the
others only train, in one SPMD program (platform/bridge.py gives each side its own world).

The generation ranks hold a copy of the policy in their own layout (parallel.generation_layout: rollout_tp,
rollout_ep, one pipeline stage), built without an optimizer, and serve the training ranks' commands:

- ``weights``: the hand-over. Each training rank gathers its parameters' canonical, unsharded tensors
  (hf/weights.py: TP shards gathered, pipeline stages and expert ranks each contributing their own, LoRA
  merged), each tensor once (TP rank 0 of the first data-parallel replica), and sends them over the
  bridge; each generation rank slices what its layout holds. Bit for bit a fresh build from the
  trainer's weights (tests/test_disaggregated.py).
- ``batch j``: the rollouts of step j, scored, as the colocated loop makes them (rollout/groups.py
  sample_groups: DAPO's dynamic sampling, multi-turn episodes, MoE routes), for every training data-
  parallel rank d, generation data-parallel rank g making those with d % G == g. The prompts come from
  the run's data stream, whose position travels with each batch back to the trainers (their checkpoints
  save it). Each batch carries the weight version it was sampled with.
- ``eval``: greedy evaluation on the validation prompts; ``stop``.

algorithm.max_staleness = k: after sending batch j (weights of step j), the generation ranks sample
batches j+1 .. j+k with those weights while the trainers train, so a batch is at most k steps older than
the weights it trains (k = 0: generation and training take turns). A resumed run regenerates the batches
after its checkpoint's data position: none is trained twice or skipped.
"""

import dataclasses
import time

import torch

from megatron_rl import platform
from megatron_rl.config import Config, ConfigError, LoRAConfig, UserError
from megatron_rl.data.batches import Batches
from megatron_rl.platform import bridge, watchdog
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.evaluate import greedy_eval
from megatron_rl.rollout.groups import Scored, sample_groups


# --- the weight hand-over ---------------------------------------------------------------------------

def _canonical_tensors(chunks: list, model) -> dict[str, torch.Tensor]:
    """This training rank's share of the policy's canonical, unsharded tensors (CPU), LoRA merged; a
    collective over the tensor-parallel ranks."""
    from megatron_rl.hf.weights import canonical, is_writer, local_tensors
    from megatron_rl.training import lora

    merged = lora.deltas(chunks)
    out = {}
    for chunk in chunks:
        for local_name, tensor in local_tensors(chunk).items():
            if local_name == "output_layer.weight" and model.tie_embeddings:
                continue  # the last stage's copy of the tied embedding: the first stage's goes
            name, place = canonical(local_name, tensor, chunk, model)
            local = tensor.detach()
            if id(tensor) in merged:
                local = local + merged[id(tensor)]
            full = place.gather(local)
            if is_writer(name):
                out[name] = full.cpu()
    return out


def hand_over(chunks: list, model) -> dict:
    """Every rank of the job: the training ranks' weights (`chunks`, their policy) into the generation ranks'
    copy (`chunks`, theirs). Returns perf/refit_s and perf/refit_mb."""
    from megatron_rl.hf.weights import canonical, local_tensors

    start = time.perf_counter()
    side, b = bridge.side(), bridge.bridge()
    mine = _canonical_tensors(chunks, model) if side.name == "train" else None
    received = {}
    for src in range(side.trainers):
        received.update(b.broadcast_tensors(mine if side.rank == src else None, src))
    if side.name == "rollout":
        with torch.no_grad():
            for chunk in chunks:
                for local_name, dst in local_tensors(chunk).items():
                    name, place = canonical(local_name, dst, chunk, model)
                    if name not in received:
                        raise RuntimeError(f"the training ranks sent no tensor {name!r} for the generation copy")
                    dst.copy_(place.slice(received[name]).to(dst.device))
    return {"perf/refit_s": time.perf_counter() - start,
            "perf/refit_mb": sum(t.numel() * t.element_size() for t in received.values()) / 2**20}


def generation_config(cfg: Config) -> Config:
    """cfg as the generation ranks build their copy: their layout, no adapters (the hand-over merges them)."""
    return dataclasses.replace(cfg, parallel=cfg.parallel.generation_layout(cfg.model), lora=LoRAConfig())


def build_generation_model(cfg: Config) -> list:
    from megatron_rl.training.frozen import freeze
    from megatron_rl.training.setup import build_model

    chunks, _ = build_model(generation_config(cfg), wrap_ddp=False)
    return freeze(chunks)


# --- the training side --------------------------------------------------------------------------------

def _leaders(cfg: Config) -> list[int]:
    """The job rank of each generation data-parallel rank's first rank (the one that sends its batches)."""
    side, tp = bridge.side(), cfg.parallel.rollout_tp
    return list(range(side.trainers, side.world_size, tp))


class Disaggregated:
    """The training ranks' end: rollouts from the generation ranks, and the weights handed to them."""

    def __init__(self, cfg: Config, run, tokenizer, train: tuple, val: tuple):
        self.cfg, self.run, self.version, self.refit, self.ready = cfg, run, None, {}, False
        bridge.bridge().broadcast_object({"tokenizer": tokenizer, "train": train, "val": val,
                                          "vocab_size": cfg.model.vocab_size,
                                          "data": run.data.state_dict()}, 0)

    def _command(self, op: str, **fields):
        watchdog.beat(f"{watchdog.WAITING} for the generation ranks")  # they may be busy sampling ahead
        if not self.ready:  # what the generation ranks found wrong setting up (a reward function, say)
            problem = bridge.bridge().broadcast_object(None, bridge.side().trainers)
            if problem:
                raise ConfigError(problem)
            self.ready = True
        bridge.bridge().broadcast_object({"op": op, **fields}, 0)

    def _hand_over(self):
        """The current weights to the generation ranks, unless they have them already."""
        if self.version != self.run.step:
            self._command("weights", version=self.run.step)
            self.refit = hand_over(self.run.trainee.model, self.cfg.model)
            self.version = self.run.step

    def sample(self, step: int, tape=None) -> tuple[Scored, dict]:
        """This data-parallel rank's scored groups of `step` and the rollout/* statistics of their sampling
        (with the staleness of every sample and the hand-over's time). tape: the trainee's RoutingTape (MoE),
        whose layers' routes are taken from the generation copy's (all layers, one stage)."""
        from megatron.core import parallel_state as ps

        self._hand_over()
        self._command("batch", step=step)
        parts = {}
        for src in _leaders(self.cfg):
            parts.update(bridge.bridge().broadcast_object(None, src))
        for part in parts.values():  # every training rank sees every part: they stop together
            platform.pass_on_preemption(part["signals"])
        batch = parts[ps.get_data_parallel_rank()]
        staleness = step - batch["version"]
        if not 0 <= staleness <= self.cfg.algorithm.max_staleness:
            raise RuntimeError(f"step {step} got rollouts of weights {batch['version']}: staleness {staleness} is "
                               f"outside [0, algorithm.max_staleness={self.cfg.algorithm.max_staleness}]")
        if batch["data_before"] != self.run.data.state_dict():  # every prompt is trained once, resumed or not
            raise RuntimeError(f"step {step}'s rollouts start at data position {batch['data_before']}, not where the "
                               f"last step's ended ({self.run.data.state_dict()})")
        self.run.data.load_state_dict(batch["data"])  # the position after this batch: what a checkpoint resumes
        refit, self.refit = self.refit, {}
        scored = batch["scored"]
        if tape is not None and scored.rollout.routes:  # this pipeline stage's (virtual stages') MoE layers
            columns = [batch["layer_numbers"].index(n) for n in tape.layer_numbers]
            scored.rollout.routes = [r[:, columns] for r in scored.rollout.routes]
        # one weight version per batch (partial rollouts across a hand-over would mix them): mean = max
        return scored, {**batch["sampling"], **refit, "rollout/staleness_mean": float(staleness),
                        "rollout/staleness_max": float(staleness), "rollout/weight_version": float(batch["version"])}

    def validate(self) -> dict:
        self._hand_over()
        self._command("eval")
        return bridge.bridge().broadcast_object(None, bridge.side().trainers)

    def finish(self):
        """The run ended normally: the generation ranks leave their loop."""
        self._command("stop")


# --- the generation side ------------------------------------------------------------------------------

class _Generator:
    """A generation rank's state: its copy of the policy, the engine on it, the scorers, the data stream."""

    def __init__(self, cfg: Config, hello: dict):
        from megatron.core import parallel_state as ps

        from megatron_rl.environments.rewards import build_scorer
        from megatron_rl.training.routing import RoutingTape
        from megatron_rl.training.setup import compute_dtype

        self.cfg, m = cfg, cfg.model
        self.tokenizer, self.train, self.val = hello["tokenizer"], hello["train"], hello["val"]
        self.chunks = build_generation_model(cfg)
        self.engine = RolloutEngine(self.chunks, m, self.tokenizer, cfg.rollout, compute_dtype(cfg))
        self.tape = RoutingTape(self.chunks, m.moe_topk, generation_config(cfg).parallel.sp) if m.num_experts else None
        self.scorer = build_scorer(cfg, cfg.rewards.fn, self.tokenizer)
        val_fn = cfg.rewards.val_fn or cfg.rewards.fn
        self.val_scorer = self.scorer if val_fn == cfg.rewards.fn else build_scorer(cfg, val_fn, self.tokenizer)
        self.data = Batches({"index": torch.arange(len(self.train[0]))}, cfg.algorithm.prompts_per_step,
                            cfg.data.seed)  # the global batches; this rank takes its training ranks' shares
        self.data.load_state_dict(hello["data"])
        self.dp_rank, self.dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.trainers_dp = cfg.parallel.data_parallel_size(cfg.parallel.trainers(bridge.side().world_size))
        self.mine = list(range(self.dp_rank, self.trainers_dp, self.dp))  # the training DP ranks served
        self.version, self.ready = None, {}  # step -> its batch, made ahead

    def _next_prompts(self):
        index = torch.cat([self.data.next()["index"][d::self.trainers_dp] for d in self.mine]).tolist()
        prompts, meta = self.train
        return [prompts[i] for i in index], [meta[i] for i in index]

    def make(self, step: int) -> dict:
        """The batches of `step` for the training ranks this rank serves, by their data-parallel rank."""
        start, before = time.perf_counter(), self.data.state_dict()
        scored, sampling = sample_groups(self.cfg, step, self.engine, self.scorer, self.tokenizer, self._next_prompts,
                                         self.dp_rank, self.tape)
        per_rank = len(scored.prompts) // len(self.mine)
        sampling["perf/generation_s"] = time.perf_counter() - start
        return {d: {"scored": scored.select(list(range(i * per_rank, (i + 1) * per_rank)), self.cfg.rollout.n),
                    "sampling": sampling, "version": self.version, "data_before": before, "data": self.data.state_dict(),
                    "layer_numbers": self.tape.layer_numbers if self.tape else []}
                for i, d in enumerate(self.mine)}

    def send(self, step: int, last: int):
        """Step's batches to the training ranks (made now if not ahead), then the next max_staleness ones made
        with the weights at hand."""
        from megatron.core import parallel_state as ps

        watchdog.beat("rollout")
        mine = self.ready.pop(step) if step in self.ready else self.make(step)
        for part in mine.values():  # a preemption signal this rank got: the training ranks stop and save
            part["signals"] = platform.signals_received()
        for src in _leaders(self.cfg):
            leader = bridge.side().rank == src and ps.get_tensor_model_parallel_rank() == 0
            bridge.bridge().broadcast_object(mine if leader else None, src)
        for ahead in range(step + 1, min(step + self.cfg.algorithm.max_staleness, last) + 1):
            if ahead not in self.ready:
                self.ready[ahead] = self.make(ahead)

    def close(self):
        for scorer in {id(s): s for s in (self.scorer, self.val_scorer)}.values():
            scorer.close()


def serve(cfg: Config) -> dict:
    """A generation rank's whole run: the training ranks' commands until they stop."""
    b = bridge.bridge()
    hello = b.broadcast_object(None, 0)
    cfg.model.vocab_size = hello["vocab_size"]
    try:
        gen, problem = _Generator(cfg, hello), None
    except UserError as e:  # the training ranks say it (job rank 0 speaks for the job), then all stop
        gen, problem = None, str(e)
    b.broadcast_object(problem, bridge.side().trainers)
    if problem:
        raise ConfigError(problem)
    watchdog.steps_started()
    try:
        while True:
            watchdog.beat(f"{watchdog.WAITING} for the training ranks")
            command = b.broadcast_object(None, 0)
            match command["op"]:
                case "weights":
                    hand_over(gen.chunks, cfg.model)
                    gen.version = command["version"]
                case "batch":
                    gen.send(command["step"], cfg.train.max_steps - 1)
                case "eval":
                    watchdog.beat("evaluation")
                    metrics = greedy_eval(gen.engine, gen.val_scorer, gen.tokenizer, *gen.val, cfg)
                    b.broadcast_object(metrics, bridge.side().trainers)
                case "stop":
                    return {}
    finally:
        gen.close()
