"""The norm of megatron-core's local (non-Transformer-Engine) spec.

megatron-core's own fallback (`WrappedTorchNorm`) refuses zero-centered gamma (Nemotron's
LayerNorm1P) and sequence parallelism. This one does both; TE's norm is used where TE is.
"""

import torch
import torch.nn.functional as F


class Norm(torch.nn.Module):
    """RMSNorm or LayerNorm over the last dimension, built by megatron's ModuleSpec machinery."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.shape = (hidden_size,)
        self.eps = eps
        self.rms = config.normalization == "RMSNorm"
        # Zero-centered: the stored weight is gamma - 1, so weight decay pulls gamma toward 1.
        self.zero_centered = config.layernorm_zero_centered_gamma
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        for p in self.parameters():
            # With sequence parallelism each TP rank sees a slice of the tokens: megatron then
            # all-reduces the gradients of parameters marked like this over the TP group.
            p.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered else self.weight
        if self.rms:
            return F.rms_norm(x, self.shape, weight, self.eps)
        return F.layer_norm(x, self.shape, weight, self.bias, self.eps)
