"""Generation with megatron-core's dynamic inference engine, on the very GPTModel that trains.

The engine wraps the training model object itself (no copy, no conversion, no refit): after an
optimizer step the next rollout uses the new weights. It runs in eval mode under
torch.inference_mode and hands the model back in train mode. The KV cache is paged (blocks) and
batching is continuous: a finished sequence leaves the batch at once and stops costing compute.
"""

import contextlib
from dataclasses import dataclass, field

import torch

from megatron_rl.config import RolloutConfig
from megatron_rl import platform
from megatron_rl.platform import watchdog


@dataclass
class Rollout:
    """Samples in request order: prompt i's n samples are rows i*n .. i*n + n - 1."""

    prompts: list[list[int]]  # per sample, the prompt token ids
    completions: list[list[int]]  # generated token ids (eos included when produced)
    logprobs: list[list[float]]  # log p of each generated token under the sampling distribution
    truncated: list[bool]  # stopped by the token budget, not by eos or a stop string
    routes: list = field(default_factory=list)  # MoE with a routing tape: per sample, experts of each fed token (tokens, layers, topk)
    masks: list = field(default_factory=list)  # multi-turn episodes: per completion token, 1 if generated, 0 if the environment's
    # top-p / top-k (rollout.top_p, top_k; empty without): per generated token, the smallest logit the sampler
    # kept (-inf: none filtered; `logprobs` are then the kept set's, renormalized), the kept set's size, and
    # the token's log p under the full distribution
    thresholds: list = field(default_factory=list)
    kept: list = field(default_factory=list)
    full_logprobs: list = field(default_factory=list)

    @property
    def lengths(self) -> list[int]:
        return [len(c) for c in self.completions]


def sampling_seed(base: int, step: int = 0, rank: int = 0, round: int = 0, batch: int = 0) -> int:
    """The seed of one call to the engine's sampler: `base` (rollout.seed, or tools/eval.py's --seed) plus 7919
    per training step, 1 per data-parallel rank, 104729 per round (a dynamic-sampling round, or a turn of a
    multi-turn episode: both add theirs) and 1000003 per batch of prompts (tools/eval.py). Each call draws
    from its own seed, the same at every layout with the same data-parallel ranks."""
    return base + 7919 * step + rank + 104729 * round + 1000003 * batch


class MegatronTokenizer:
    """The tokenizer interface megatron-core's inference stack calls, on a Hugging Face tokenizer."""

    def __init__(self, hf):
        self.hf = hf

    def tokenize(self, text: str) -> list[int]:
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def detokenize(self, ids, **_unused) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    @property
    def eod(self) -> int:
        return self.hf.eos_token_id

    @property
    def bos(self) -> int:
        return self.hf.bos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.hf)


def _wrapper_class():
    from megatron.core.inference.communication_utils import (
        is_pipeline_first_stage, is_pipeline_last_stage, recv_from_prev_pipeline_rank_, send_to_next_pipeline_rank)
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

    class TraineeWrapper(GPTInferenceWrapper):
        """GPTInferenceWrapper whose logits exclude the padding rows of the vocabulary (which megatron
        would otherwise sample from), exactly as the training loss does; and which runs a virtual
        pipeline (megatron-core's inference runs one model chunk per rank): the chunks go round the
        pipeline ring in order, chunk v of the last stage sending to chunk v + 1 of the first."""

        vocab_size: int = 0
        chunks: list = []  # this rank's model chunks (without DDP), in layer order

        def run_one_forward_step(self, inference_input, *args, **kwargs):
            logits = super().run_one_forward_step(inference_input, *args, **kwargs)
            if logits is not None:
                logits[..., self.vocab_size:] = float("-inf")
            return logits

        def forward_pass_with_pipeline_parallel_small_input_batch(self, inference_input, recv_buffer_seq_len=None):
            if len(self.chunks) == 1:
                return super().forward_pass_with_pipeline_parallel_small_input_batch(inference_input, recv_buffer_seq_len)
            batch_size, seq_len = self._get_batch_size_and_seq_len(inference_input["tokens"], recv_buffer_seq_len)
            first, last = is_pipeline_first_stage(self.pp_group), is_pipeline_last_stage(self.pp_group)
            for v, chunk in enumerate(self.chunks):
                received = None
                if not (first and v == 0):
                    received = self._allocate_recv_buffer(batch_size, seq_len)
                    recv_from_prev_pipeline_rank_(received, self.pp_group)
                chunk.set_input_tensor(received)
                output = chunk(inference_input["tokens"], inference_input["position_ids"],
                               inference_input["attention_mask"], inference_context=self.inference_context,
                               runtime_gather_output=True)  # as _forward calls the (one) model
                if not (last and v == len(self.chunks) - 1):
                    send_to_next_pipeline_rank(output.type(dtype=self.pipeline_communication_dtype), self.pp_group)
            self.inference_context.increment_sequence_len_offset(seq_len)
            return output.to(self.inference_wrapper_config.params_dtype) if last else None

    return TraineeWrapper


def cuts(top_k: int, top_p: float) -> bool:
    """Whether sampling with these settings keeps only part of the vocabulary (top_k=1 is greedy)."""
    return top_k > 1 or 0.0 < top_p < 1.0


def sampling_threshold(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Per row of logits (n, V), a threshold below which the sampler drops every logit: the k largest
    logits are kept for top-k; for top-p the nucleus, the smallest prefix (most likely first) whose
    probability at this temperature reaches top_p; -inf where nothing is filtered. Ties with the last
    kept logit are kept, and the threshold lies midway between that logit and the next lower one, so a
    training forward whose logits round slightly differently keeps the same set."""
    logits = logits.float()
    if top_k > 1:
        return _midway_below(logits, torch.topk(logits, top_k, dim=-1).values[:, -1])
    if 0.0 < top_p < 1.0:
        ordered = logits.sort(dim=-1, descending=True).values
        probs = (ordered / temperature).softmax(dim=-1)
        before = torch.cat([torch.zeros_like(probs[:, :1]), probs.cumsum(dim=-1)[:, :-1]], dim=-1)
        last = (before < top_p).sum(dim=-1, keepdim=True) - 1  # the nucleus is complete after it
        return _midway_below(ordered, ordered.gather(-1, last)[:, 0])
    return torch.full((len(logits),), float("-inf"), device=logits.device)


def _midway_below(logits: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Per row, halfway between `last` and the largest logit below it (-inf where there is none)."""
    lower = logits.masked_fill(logits >= last[:, None], float("-inf")).max(dim=-1).values
    return torch.where(lower.isneginf(), lower, (last + lower) / 2)


def _fast_sampling_controller_class():
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController)

    class FastSamplingController(TextGenerationController):
        """megatron-core's controller, drawing each token by inverse CDF (one uniform number per row)
        rather than torch.multinomial, which on CPU draws a random number per vocabulary entry
        (12 ms for 64 x 8192 probabilities). The same distribution: temperature, then top-k or
        top-p (sampling_threshold). Each sampled token's log-prob is under the distribution it was
        drawn from: the kept set's, renormalized (at temperature 1, as training computes it); with it
        the controller returns the kept set's threshold logit and size and the full distribution's
        log-prob (a record per token, which RolloutEngine.generate unpacks)."""

        thresholds: torch.Tensor | None = None  # this step's, per active request
        filtering = False  # whether any of this step's requests samples with top-p / top-k

        def _sample(self, logits, temperature, top_k, top_p) -> tuple[torch.Tensor, torch.Tensor]:
            """(sampled ids, thresholds) of logits (n, V)."""
            if top_k == 1:  # greedy: its log-probs stay the full distribution's
                return logits.argmax(dim=-1), sampling_threshold(logits, temperature, 0, 0.0)
            threshold = sampling_threshold(logits, temperature, top_k, top_p)
            logits = logits.float()
            probs = (logits.masked_fill(logits < threshold[:, None], float("-inf")) / temperature).softmax(dim=-1)
            cdf = probs.cumsum(dim=-1)
            # 1 - U lies in (0, 1]: a zero-probability first token can never be drawn
            u = (1.0 - torch.rand(len(cdf), 1, generator=self.sampling_rng, device=cdf.device)) * cdf[:, -1:]
            return torch.searchsorted(cdf, u).squeeze(-1).clamp(max=cdf.shape[-1] - 1), threshold

        def _torch_sampling_func(self, logits, temperature, top_k, top_p, vocab_size=None):
            return self._sample(logits, temperature, top_k, top_p)[0]

        def _dynamic_step_sample_logits(self, logits):
            # megatron's, for its torch backend, keeping each row's threshold; the engine always
            # materializes only the last token's logits
            last = logits.squeeze(0)
            self.thresholds = torch.full((len(last),), float("-inf"), device=last.device)
            self.filtering = False
            for indices, temp, top_k, top_p in self._torch_sampling_buckets:
                self.filtering |= cuts(top_k, top_p)
                rows = torch.tensor(indices, device=last.device)
                self._sampled_tokens_cuda[rows], self.thresholds[rows] = self._sample(last[rows], temp, top_k, top_p)

        def _dynamic_step_calculate_log_probs(self, logits):
            context = self.inference_wrapped_model.inference_context
            n = context.total_request_count - context.paused_request_count
            last, tokens, threshold = logits.squeeze(0)[:n].float(), self._sampled_tokens_cuda[:n, None], self.thresholds[:n]
            full = last.log_softmax(dim=-1)
            filtered, size = full, torch.zeros_like(threshold)  # without a filter nobody reads the sizes
            if self.filtering:
                kept = last >= threshold[:, None]
                filtered, size = last.masked_fill(~kept, float("-inf")).log_softmax(-1), kept.sum(dim=-1).float()
            records = torch.stack([filtered.gather(-1, tokens)[:, 0], full.gather(-1, tokens)[:, 0], threshold, size],
                                  dim=1)
            return [[tuple(r)] for r in records.tolist()], full

    return FastSamplingController


def kv_cache_layout(m) -> tuple[int, int]:
    """(heads, channels per head) of each cached token's keys (and values) over all TP ranks; for
    multi-latent attention, which caches one latent per token (model_providers/latent_attention.py),
    (1, its channels)."""
    if m.multi_latent_attention:
        return 1, m.kv_lora_rank + m.qk_pos_head_dim
    return m.num_query_groups or m.num_attention_heads, m.head_dim or m.hidden_size // m.num_attention_heads


def _context_class():
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    class TraineeContext(DynamicInferenceContext):
        """megatron-core's dynamic context, keeping a hybrid's SSM states in fp32 whatever the model's
        dtype: each decode step adds to them, and in bf16 every step would round them, while the
        training scan carries them in fp32 (transformers keeps them so too). The convolution states
        are copies of the layer's inputs, exact in the model's dtype.

        The context pads each step's tokens to a multiple of TOKEN_ROUNDER (64: GPU kernels and CUDA
        graphs like round sizes). On CPU that padding is pure cost once sequences finish: 1 active
        request would still compute 64 rows. Round to 8 there."""

        if not platform.has_cuda():
            TOKEN_ROUNDER = 8

        def initialize_attention_state(self, **kwargs) -> None:
            """megatron's, then the step's key count for our paged attention (platform/paged_attention.py),
            so that its forward reads nothing from the device (a host number already: the longest
            request's keys, or in a CUDA-graphed step the static maximum)."""
            from megatron_rl.platform import paged_attention

            super().initialize_attention_state(**kwargs)
            paged_attention.plan_step(int(self.cu_kv_lengths()[2]))

        def allocate_all_tensors(self, *, is_init: bool) -> None:
            super().allocate_all_tensors(is_init=is_init)
            if self.is_hybrid_model and self.mamba_ssm_states.dtype != torch.float32:
                self.mamba_ssm_states = self.mamba_ssm_states.float()

    return TraineeContext


def _mamba_states(chunks):
    """A hybrid's per-request Mamba state shapes and this rank's layer kinds, for the engine's context
    (megatron's dynamic context keeps each Mamba layer's convolution and SSM state per request)."""
    import dataclasses

    from megatron.core.utils import get_mamba_inference_state_config_from_model

    config = get_mamba_inference_state_config_from_model(chunks[0])
    if config is not None and "*" not in config.layer_type_list:
        # megatron's context refuses a rank without attention layers, which a pipeline stage of a
        # hybrid may be: one KV-cache layer after the rank's own, never used, keeps it working
        config = dataclasses.replace(config, layer_type_list=[*config.layer_type_list, "*"])
    return config


def _expert_group():
    """The expert-parallel group, where there is one of several ranks."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_group() if ps.get_expert_model_parallel_world_size() > 1 else None


def _drop_inference_buffers():
    """megatron's global memory buffer (the sequence-parallel all-gather's scratch space) grows
    lazily; what it allocated during the rollout are inference tensors, which training may not
    write to. Drop them: training allocates its own."""
    from megatron.core.parallel_state import get_global_memory_buffer

    buffers = get_global_memory_buffer().buffer
    for key in [k for k, t in buffers.items() if t.is_inference()]:
        del buffers[key]


class RolloutEngine:
    def __init__(self, model_chunks: list, model_cfg, tokenizer, rollout: RolloutConfig, dtype: torch.dtype,
                 stop_at_eos: bool = True):
        """model_chunks: the trainee's model (DDP-wrapped is fine), all of this rank's chunks.
        stop_at_eos=False generates exactly rollout.max_new_tokens tokens (benchmarks)."""
        from megatron.core.inference.engines import DynamicInferenceEngine
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
        from megatron.core.utils import get_attr_wrapped_model
        from model_providers.builder import padded_vocab_size

        self.chunks = model_chunks
        unwrapped = [c.module if hasattr(c, "ddp_config") else c for c in model_chunks]
        self.model = unwrapped[0]
        self.tokenizer = tokenizer
        self.cfg = rollout
        self.termination_id = tokenizer.eos_token_id if stop_at_eos else -1
        m = model_cfg
        heads, kv_channels = kv_cache_layout(m)
        if m.multi_latent_attention:
            heads = m.num_attention_heads  # unused by the latent cache, but megatron divides it by TP
        layers = sum(len(get_attr_wrapped_model(c, "decoder").layers) for c in unwrapped)  # this rank's (cached)
        # decode-only CUDA graphs where the model was built for them (rollout.cuda_graphs on CUDA)
        graphs = get_attr_wrapped_model(self.model, "config").cuda_graph_impl == "local"
        self.context = _context_class()(
            params_dtype=dtype, num_layers=layers, kv_channels=kv_channels, num_attention_heads=heads,
            max_sequence_length=rollout.max_sequence_length, buffer_size_gb=rollout.kv_cache_gb,
            max_requests=rollout.max_requests, block_size_tokens=rollout.block_size_tokens,
            max_tokens=rollout.max_tokens, materialize_only_last_token_logits=True,
            num_cuda_graphs=rollout.num_cuda_graphs if graphs else None, use_cuda_graphs_for_non_decode_steps=False,
            mamba_inference_state_config=_mamba_states(unwrapped) if m.hybrid_pattern else None,
            **(dict(cache_mla_latent=True, kv_lora_rank=m.kv_lora_rank, qk_pos_emb_head_dim=m.qk_pos_head_dim)
               if m.multi_latent_attention else {}))
        wrapper_config = InferenceWrapperConfig(
            hidden_size=m.hidden_size, params_dtype=dtype, inference_batch_times_seqlen_threshold=-1,
            padded_vocab_size=padded_vocab_size(m.vocab_size), inference_max_requests=rollout.max_requests,
            inference_max_seq_length=rollout.max_sequence_length)
        wrapper = _wrapper_class()(self.model, wrapper_config, self.context)
        wrapper.vocab_size, wrapper.chunks = m.vocab_size, unwrapped
        self.controller = _fast_sampling_controller_class()(wrapper, MegatronTokenizer(tokenizer))
        self.expert_group = _expert_group()
        with self._eval(), torch.inference_mode():  # CUDA graphs (where on) are captured now, as decode steps run
            self.engine = DynamicInferenceEngine(self.controller, self.context, random_seed=rollout.seed)

    @contextlib.contextmanager
    def _eval(self):
        """The model in eval mode, as the engine runs it; back in train mode after, without the inference
        tensors megatron's buffers kept."""
        for chunk in self.chunks:
            chunk.eval()
        try:
            yield
        finally:
            for chunk in self.chunks:
                chunk.train()
            _drop_inference_buffers()

    def sampling_params(self, greedy: bool = False, stop: list[str] | None = None, max_new_tokens: int = 0):
        """stop: the stop strings (default rollout.stop); max_new_tokens: default rollout.max_new_tokens."""
        from megatron.core.inference.sampling_params import SamplingParams

        r = self.cfg
        stop = list(r.stop) if stop is None else stop
        return SamplingParams(
            temperature=1.0 if greedy else r.temperature, top_k=1 if greedy else r.top_k,
            top_p=0.0 if greedy else r.top_p, num_tokens_to_generate=max_new_tokens or r.max_new_tokens,
            return_log_probs=True, skip_prompt_log_probs=True, termination_id=self.termination_id,
            stop_words=stop or None)

    def anyone(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank of this one's expert-parallel group (itself alone without expert
        parallelism). Under expert parallelism every forward exchanges tokens with the group's other ranks,
        each holding its own requests: the group steps together while any of them has work, a rank without
        any running megatron's one-token dummy forward."""
        if self.expert_group is None:
            return flag
        import torch.distributed as dist

        t = torch.tensor([float(flag)], device=platform.device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.expert_group)
        return bool(t.item())

    def filters(self, greedy: bool = False) -> bool:
        """Whether sampling keeps only part of the vocabulary (rollout.top_p, top_k > 1)."""
        return not greedy and cuts(self.cfg.top_k, self.cfg.top_p)

    def generate(self, prompts: list[list[int]], n: int = 1, seed: int = 0, greedy: bool = False,
                 tape=None, stops: list[list[str]] | None = None, max_new_tokens: list[int] | None = None,
                 routes: list | None = None) -> Rollout:
        """n samples for each prompt (token ids), reproducible for a given seed. tape: a RoutingTape
        of the model, which then records the experts every MoE layer chose for every token fed. stops,
        max_new_tokens and routes: each prompt's own stop strings, token budget and the experts of its
        first tokens from an earlier turn, which route them again (multi-turn episodes)."""
        stops = stops or [None] * len(prompts)
        budgets = max_new_tokens or [0] * len(prompts)
        self.engine.reset()
        self.controller.sampling_rng.manual_seed(seed)
        order, done = [], {}
        with self._eval():
            for i, prompt in enumerate(prompts):
                params = self.sampling_params(greedy, stops[i], budgets[i])
                for j in range(n):
                    request_id = i * n + j
                    self.engine.add_request(request_id, list(prompt), params)
                    order.append(request_id)
            if tape is not None:
                tape.start_recording(self.context, {k: routes[k // n] for k in order} if routes else None)
            with torch.inference_mode(), platform.weights_unchanged():  # no weight changes during a rollout
                while self.anyone(self.engine.has_unfinished_requests()):
                    watchdog.beat("rollout")
                    if not self.engine.has_unfinished_requests():  # done: its experts still serve the others
                        self.controller.inference_wrapped_model.dummy_forward()
                        continue
                    for record in self.engine.step_modern()["finished_request_records"]:
                        request = record.merge()
                        done[request.request_id] = request
        samples = [done[i] for i in order]
        prompt_ids = [r.prompt_tokens.tolist() for r in samples]
        completions = [list(r.generated_tokens) for r in samples]
        fed = [len(p) + len(c) - 1 for p, c in zip(prompt_ids, completions)]  # the last token is never fed
        # per token (log p, full log p, threshold, kept); a request stopped by a stop string runs one more
        # step whose record megatron keeps but whose token it drops
        records = [list(zip(*(r.generated_log_probs or [])[: len(c)])) or [()] * 4 for r, c in zip(samples, completions)]
        filtered = self.filters(greedy)
        return Rollout(
            prompts=prompt_ids,
            completions=completions,
            logprobs=[list(r[0]) for r in records],
            thresholds=[list(r[2]) for r in records] if filtered else [],
            kept=[[int(k) for k in r[3]] for r in records] if filtered else [],
            full_logprobs=[list(r[1]) for r in records] if filtered else [],
            truncated=[len(c) >= (budgets[k // n] or self.cfg.max_new_tokens) and not self._ended(c, stops[k // n])
                       for k, c in enumerate(completions)],
            routes=tape.collect(order, fed) if tape is not None else [])

    def _ended(self, completion: list[int], stop: list[str] | None = None) -> bool:
        """Whether generation stopped by itself: eos, or a stop string at the end."""
        if completion and completion[-1] == self.termination_id:
            return True
        stop = self.cfg.stop if stop is None else stop
        return bool(stop) and self.tokenizer.decode(completion).endswith(tuple(stop))
