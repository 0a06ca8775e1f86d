"""Core attention of the local (non-Transformer-Engine) spec, on torch's scaled_dot_product_attention.

megatron-core's local `DotProductAttention` needs equal q/k and v head sizes, so multi-latent
attention (DeepSeek) cannot be built with it. This one takes separate sizes, grouped-query
attention, causal masks aligned to the end of the keys (a KV cache holds more keys than there are
new queries), sliding windows and megatron's explicit masks.
"""

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


def causal_mask(sq: int, sk: int, window: int = 0, device=None) -> torch.Tensor:
    """(sq, sk) bool, True where query i (at position sk - sq + i) may attend to key j."""
    q_pos = torch.arange(sk - sq, sk, device=device).unsqueeze(1)
    k_pos = torch.arange(sk, device=device).unsqueeze(0)
    allowed = k_pos <= q_pos
    if window:
        allowed &= k_pos > q_pos - window
    return allowed


class CoreAttention(MegatronModule):
    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise NotImplementedError("context parallelism is not supported by the local spec's attention yet.")
        self.attn_mask_type = attn_mask_type
        self.scale = softmax_scale if softmax_scale is not None else (k_channels or config.kv_channels) ** -0.5
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.window = config.window_size[0] + 1 if config.window_size else 0

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_unused):
        """query (sq, b, heads, dk), key (sk, b, groups, dk), value (sk, b, groups, dv) -> (sq, b, heads * dv)."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("packed sequences and attention bias need Transformer Engine's attention.")
        sq, b, heads, _ = query.shape
        sk, groups = key.shape[0], key.shape[2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, heads or groups, s, d)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        mask, is_causal = None, False
        if attention_mask is not None:
            mask = ~attention_mask  # megatron's masks are True where attention is *not* allowed
        elif mask_type == AttnMaskType.causal:
            if sq == sk and not self.window:
                is_causal = True
            else:
                mask = causal_mask(sq, sk, self.window, device=q.device)
        if self.window and attention_mask is not None:
            mask = mask & causal_mask(sq, sk, self.window, device=q.device)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0, enable_gqa=groups != heads)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # (sq, b, heads * dv)
