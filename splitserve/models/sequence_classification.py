"""Decoders with a classification head (transformers' `*ForSequenceClassification`: Qwen3, Qwen2,
Llama, Mistral): cross-encoder rerankers and classifiers, served by the pooling runner. The
prompt's last token's final hidden state goes through the head (`score`, num_labels x hidden, no
bias) to num_labels logits; executor/pooler.py applies it, the front-ends turn the logits into
probabilities (engine-side: pooling_params.classifier_activation)."""

from __future__ import annotations

import torch
from torch import nn

from splitserve.models.llama import LlamaForCausalLM


class LlamaForSequenceClassification(LlamaForCausalLM):
    """The decoder of LlamaForCausalLM (every architecture it runs) without the LM head, and the
    classification head, replicated on every tensor-parallel rank (it is num_labels rows)."""

    def __init__(self, config, dtype: torch.dtype, max_position: int, quant_config=None):
        super().__init__(config, dtype, max_position, quant_config)
        if hasattr(self, "lm_head"):
            del self.lm_head  # the checkpoint has none; the logits are the head's
        self.head_is_embedding = False
        self.num_labels = int(getattr(config, "num_labels", 1) or 1)
        if self.model.is_last_stage:
            self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False, dtype=dtype)

    def compute_logits_embedding(self):
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """A pooling request samples one token that nobody sees (engine/processor.py): one logit,
        token 0, in place of the vocabulary's (the model has no LM head)."""
        return hidden.new_zeros(hidden.shape[0], 1, dtype=torch.float32)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled hidden states [..., hidden] (float32) -> the head's logits [..., num_labels], float32."""
        return self.score(pooled.to(self.score.weight.dtype)).float()

    def _targets(self, name: str) -> list[tuple[str, int | None]]:
        if name == "lm_head.weight":  # a converted checkpoint may keep its LM head: unused here
            return []
        if name == "model.embed_tokens.weight":  # never the head here, tied or not
            return [(name, None)] if self.model.is_first_stage else []
        return super()._targets(name)
