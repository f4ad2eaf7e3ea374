"""Image embeddings in the model runner: the vision encoder runs on the images a step's prompt tokens
reach, and its output is kept by image identifier (the encoder cache), so that an image whose prompt
is computed in several chunks, repeated within a prompt, or sent again by later requests is encoded
once while its embeddings stay cached.

A step's rows name the parts of each image's embeddings they take (InputBatch.mm_spans); the step's
input embeddings are the token embeddings with those rows put in place of the image's placeholder
tokens, and the language model starts from them (LlamaModel.forward's inputs_embeds).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import NamedTuple

import torch

from splitserve.multimodal.inputs import MultiModalFeature

logger = logging.getLogger(__name__)

DEFAULT_CACHE_TOKENS = 16384  # image embeddings (rows) kept past the step that made them


class MultiModalSpan(NamedTuple):
    """Embedding rows lo .. hi - 1 of an image, placed at the step's tokens dst .. dst + hi - lo - 1."""

    feature: MultiModalFeature
    lo: int
    hi: int
    dst: int


class EncoderCache:
    def __init__(self, device: torch.device, max_tokens: int = DEFAULT_CACHE_TOKENS):
        self.device = device
        self.max_tokens = max_tokens
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()  # least recently used first
        self.num_encoded = 0  # images run through the encoder
        self.num_hits = 0  # images a step found here

    def inputs_embeds(self, model, input_ids: torch.Tensor, spans: list[MultiModalSpan]) -> torch.Tensor:
        """The step's input embeddings [tokens, hidden] with the spans' image rows in place."""
        embeds = model.embed_input_ids(input_ids)
        found = self.embeddings(model, [span.feature for span in spans])
        for span in spans:
            rows = found[span.feature.identifier][span.lo : span.hi]
            embeds[span.dst : span.dst + span.hi - span.lo] = rows.to(embeds.dtype)
        return embeds

    def embeddings(self, model, features: list[MultiModalFeature]) -> dict[str, torch.Tensor]:
        """Each feature's whole embeddings [length, hidden], encoding the ones not cached (in one call:
        the model batches them), then evicting the least recently used past the budget."""
        wanted = {f.identifier: f for f in features}
        missing = [f for key, f in wanted.items() if key not in self.entries]
        self.num_hits += len(wanted) - len(missing)
        if missing:
            encoded = model.embed_images([self._inputs(f) for f in missing])
            self.num_encoded += len(missing)
            for feature, rows in zip(missing, encoded):
                if rows.shape[0] != feature.length:
                    raise RuntimeError(
                        f"The vision encoder made {rows.shape[0]} embeddings of an image that has "
                        f"{feature.length} placeholder tokens in the prompt."
                    )
                self.entries[feature.identifier] = rows
        for key in wanted:
            self.entries.move_to_end(key)
        found = {key: self.entries[key] for key in wanted}
        self._evict(keep=len(wanted))
        return found

    def _inputs(self, feature: MultiModalFeature) -> dict[str, torch.Tensor]:
        if "pixel_values" not in feature.data:
            raise RuntimeError(
                f"Image {feature.identifier[:12]} has no pixels here (its KV came from a prefill instance), yet "
                "the step computes its tokens."
            )
        return {name: torch.from_numpy(t.to_array().copy()).to(self.device) for name, t in feature.data.items()}

    def _evict(self, keep: int) -> None:
        """Drop the least recently used entries past max_tokens, never the `keep` used last."""
        total = sum(rows.shape[0] for rows in self.entries.values())
        while total > self.max_tokens and len(self.entries) > keep:
            _, rows = self.entries.popitem(last=False)
            total -= rows.shape[0]

    def clear(self) -> None:
        self.entries.clear()
