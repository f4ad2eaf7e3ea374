"""ERNIE 4.5 dense (Ernie4_5ForCausalLM): Llama with a bias on every linear when `use_bias` is set,
and an interleaved rotary (GPT-J / GLM style: pairs (2i, 2i+1) turn by frequency i) computed in
float32.

The rotation is done by the rotate-half kernels after moving each head's channels from pairs to
halves, (2i, 2i+1) -> (i, i + D/2), in q and k alike. Attention only reads q.k, which a common
permutation of the channels leaves unchanged, and v is not touched, so this is exact. Permuting
after the projection, rather than permuting the q/k weight rows once at load time, works the same
for dense, quantized (AWQ / GPTQ pack output channels in their own layouts) and LoRA weights
(whose deltas land in the projection's output): one small copy of q and k per layer buys that.
"""

from __future__ import annotations

import torch

from splitserve.layers.rotary import PositionEncoding, apply_rotary
from splitserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


def pairs_to_halves(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> [T, H, D] with channel 2i moved to i and 2i + 1 to i + D/2."""
    tokens, heads, dim = x.shape
    return x.view(tokens, heads, dim // 2, 2).transpose(-1, -2).reshape(tokens, heads, dim)


class Ernie4_5Attention(LlamaAttention):
    rotary_dtype = torch.float32  # transformers rotates ERNIE 4.5's q and k in float32

    @staticmethod
    def biases(config) -> tuple[bool, bool]:
        return bool(config.use_bias), bool(config.use_bias)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, encoding: PositionEncoding):
        dtype = q.dtype
        q, k = apply_rotary(pairs_to_halves(q).float(), pairs_to_halves(k).float(), encoding)
        return q.to(dtype), k.to(dtype)


class Ernie4_5MLP(LlamaMLP):
    @staticmethod
    def has_bias(config) -> bool:
        return bool(config.use_bias)


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    attention_cls = Ernie4_5Attention
    mlp_cls = Ernie4_5MLP
