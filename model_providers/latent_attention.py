"""Multi-latent attention (DeepSeek) that rolls out from a paged cache of latents, on the module that trains.

megatron-core's own MLA inference (`config.cache_mla_latents`) cannot serve the trainee: it splits
a Transformer-Engine-only fused layer, deletes `linear_kv_up_proj` from the module, refuses
training, and decodes with FlashMLA kernels; without it the dynamic engine refuses MLA. Here
training is megatron's forward unchanged, and with megatron's dynamic inference context:

- each token's cache entry is what MLA compresses the keys and values to: the normalized latent
  (kv_lora_rank channels) and the rotary key (qk_pos_head_dim), in megatron's latent cache layout
  (`DynamicInferenceContext(cache_mla_latent=True)`); the same on every tensor-parallel rank;
- every step, the latents of the requests in the batch are up-projected to per-head keys and
  values by the module's own `linear_kv_up_proj`, and the paged attention of
  platform/paged_attention.py runs on them.

Queries are computed as in training (the same layers and rotary embedding at each token's
position). Weight absorption (attending in latent space) and FlashMLA would make decode cheaper on
a GPU; they are not used.
"""

from contextlib import contextmanager

import torch
from megatron.core.tensor_parallel import (
    gather_from_sequence_parallel_region, gather_from_tensor_model_parallel_region, scatter_to_sequence_parallel_region)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megatron_rl.platform.paged_attention import flash_attn_varlen_func, flash_attn_with_kvcache


@contextmanager
def _whole_sequence(linear):
    """The linear layer applied to inputs that are not split over the sequence: a sequence-parallel
    layer would all-gather them first. The cached latents are whole on every rank."""
    saved = linear.sequence_parallel
    linear.sequence_parallel = False
    try:
        yield
    finally:
        linear.sequence_parallel = saved


class LatentCacheMLASelfAttention(MLASelfAttention):
    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None, **kwargs):
        """megatron's forward, except with a dynamic inference context (the rollout engine): then the
        step's tokens' latents go to the cache, and their queries attend to the up-projected cache."""
        if inference_context is None or inference_context.is_static_batching():
            return super().forward(hidden_states, attention_mask, key_value_states, inference_context, **kwargs)
        ctx = inference_context
        query, latent = self._query_and_latent(hidden_states, ctx)
        layer = self.layer_number - self._get_pp_layer_offset_for_inference()
        ctx.append_key_value_cache(layer, latent, None)
        cache, _, block_table = ctx.key_value_cache(layer)
        cu_q, max_q = ctx.cu_query_lengths()
        cu_k, k_lengths, max_k = ctx.cu_kv_lengths()
        keys, values, block_table = self._up_project(cache, block_table, int(max_k))
        if ctx.is_decode_only():  # one query per request: (requests, 1, heads, d)
            out = flash_attn_with_kvcache(query, keys, values, k_lengths, block_table, softmax_scale=self.softmax_scale)
        else:  # packed queries of several requests: (tokens, heads, d)
            out = flash_attn_varlen_func(query.squeeze(1), keys, values, cu_q, cu_k, max_q, max_k,
                                         softmax_scale=self.softmax_scale, block_table=block_table)
        return self.linear_proj(out.reshape(out.shape[0], 1, -1))

    def _query_and_latent(self, hidden_states, ctx):
        """Queries (tokens, 1, heads, qk + rotary channels) and cache entries (tokens, 1, kv_lora_rank
        + rotary channels) of the step's tokens, both whole over the sequence; hidden_states are split
        over it with sequence parallelism (megatron's layers gather and scatter as in training)."""
        c = self.config
        tp_sp = c.sequence_parallel and self.pg_collection.tp.size() > 1
        if c.q_lora_rank is not None:
            q_compressed, _ = self.linear_q_down_proj(hidden_states)
            if q_compressed.size(-1) != c.q_lora_rank:
                q_compressed = gather_from_tensor_model_parallel_region(q_compressed)
                if c.sequence_parallel:
                    q_compressed = scatter_to_sequence_parallel_region(q_compressed)
            q, _ = self.linear_q_up_proj(self.q_layernorm(q_compressed))
        else:
            q, _ = self.linear_q_proj(hidden_states)
        kv, _ = self.linear_kv_down_proj(hidden_states)
        if kv.size(-1) != c.kv_lora_rank + c.qk_pos_emb_head_dim:
            kv = gather_from_tensor_model_parallel_region(kv)  # a column-parallel layer gathered the sequence
        elif tp_sp:
            kv = gather_from_sequence_parallel_region(kv, group=self.pg_collection.tp)
        kv_compressed, k_pos = kv.split([c.kv_lora_rank, c.qk_pos_emb_head_dim], dim=-1)

        # rotary embeddings at each token's position in its request (megatron's latent path does the same)
        length = self.rotary_pos_emb.get_rotary_seq_len(ctx, None, hidden_states, c, None)
        if c.rope_type == "rope":
            emb, mscale = self.rotary_pos_emb(length), 1.0
        else:
            emb, mscale = self.rotary_pos_emb(length)
        q = q.view(*q.shape[:-1], self.num_attention_heads_per_partition, self.q_head_dim)
        q_nope, q_pos = q.split([c.qk_head_dim, c.qk_pos_emb_head_dim], dim=-1)
        q_pos = ctx.apply_rotary_emb_query(q_pos, emb, config=c, cu_seqlens_q=None, cp_group=self.pg_collection.cp,
                                           mscale=mscale)
        k_pos = ctx.apply_rotary_emb_key(k_pos.unsqueeze(-2), emb, config=c, cp_group=self.pg_collection.cp,
                                         mscale=mscale)
        query = torch.cat([q_nope, q_pos], dim=-1)
        latent = torch.cat([self.kv_layernorm(kv_compressed), k_pos.squeeze(-2)], dim=-1)
        return query, latent

    def _up_project(self, cache, block_table, max_k: int):
        """Keys (blocks, block size, heads, qk + rotary channels) and values (..., v channels) of the
        blocks the batch's requests use, from the latent cache (blocks, block size, kv_lora_rank +
        rotary channels), and the block table into them."""
        c = self.config
        size = cache.shape[1]
        used = block_table[:, : max(1, -(-max_k // size))]
        latents = cache.index_select(0, used.clamp(min=0).flatten())  # -1 marks unused slots: masked by length
        kv_compressed, k_pos = latents.split([c.kv_lora_rank, c.qk_pos_emb_head_dim], dim=-1)
        with _whole_sequence(self.linear_kv_up_proj):
            kv, _ = self.linear_kv_up_proj(kv_compressed)
        heads = self.num_attention_heads_per_partition
        k_nope, values = kv.view(*kv.shape[:-1], heads, c.qk_head_dim + c.v_head_dim).split(
            [c.qk_head_dim, c.v_head_dim], dim=-1)
        keys = torch.cat([k_nope, k_pos.unsqueeze(-2).expand(-1, -1, heads, -1)], dim=-1)
        table = torch.arange(used.numel(), device=used.device).view(used.shape)
        return keys, values, table
