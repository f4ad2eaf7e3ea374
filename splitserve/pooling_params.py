"""Pooling: a request that asks for its prompt's embedding instead of a continuation, with vLLM's
names. `PoolingParams` is what a request sets; `PoolerConfig` is how a model pools (`--pooler-config`),
read from the model's sentence-transformers files when it has them.

A pooling request runs the prompt through the model once (chunked like any prompt) and pools the
final hidden states (after the last norm) of its tokens: the last token's (LAST), their mean
(MEAN) or the first token's (CLS); `normalize` scales the vector to unit length; `dimensions`
keeps its first so many values (Matryoshka embeddings), before normalizing.

A classification model (`*ForSequenceClassification`: a cross-encoder reranker or a classifier)
pools its prompt's last token and puts it through its head: the pooled vector is then its
num_labels logits, which `classifier_activation` turns into probabilities."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import msgspec

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' 1_Pooling/config.json keys -> pooling types
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


class PoolingParams(msgspec.Struct, omit_defaults=True):
    """What one pooling request asks for (vLLM's PoolingParams). None: the model's pooler config.
    pooling_type is filled in by the engine from the pooler config."""

    dimensions: int | None = None
    normalize: bool | None = None
    pooling_type: str | None = None

    def clone(self) -> PoolingParams:
        return msgspec.structs.replace(self)


@dataclass
class PoolerConfig:
    """How the model pools (vLLM's --pooler-config): pooling_type LAST, MEAN or CLS; normalize the
    vector to unit length; matryoshka_dimensions: the lengths `dimensions` may take (None: any
    length up to the hidden size is refused unless the model says it was trained for it)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    matryoshka_dimensions: list[int] | None = None

    def __post_init__(self) -> None:
        self.pooling_type = str(self.pooling_type).upper()
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}; got {self.pooling_type!r}.")

    @classmethod
    def resolve(cls, model_dir: str | None, hf_config, overrides: dict | str | None) -> PoolerConfig:
        """The model's own pooling (sentence-transformers' files in model_dir, then the config's
        `matryoshka_dimensions` / `is_matryoshka`), with `overrides` (a dict or its JSON) over it."""
        found: dict = {"normalize": False} if is_classifier(hf_config) else {}  # logits, not an embedding
        if model_dir and os.path.isdir(model_dir):
            found.update(_sentence_transformers_pooling(model_dir))
        dims = getattr(hf_config, "matryoshka_dimensions", None)
        if dims:
            found["matryoshka_dimensions"] = list(dims)
        elif getattr(hf_config, "is_matryoshka", False):
            found["matryoshka_dimensions"] = []  # any length
        if isinstance(overrides, str):
            try:
                overrides = json.loads(overrides)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--pooler-config is not JSON: {exc}") from None
        unknown = set(overrides or {}) - {"pooling_type", "normalize", "matryoshka_dimensions"}
        if unknown:
            raise ValueError(
                f"--pooler-config takes pooling_type, normalize and matryoshka_dimensions; got {sorted(unknown)}"
            )
        return cls(**{**found, **(overrides or {})})

    def allows_dimensions(self, dimensions: int, hidden_size: int) -> str | None:
        """Why `dimensions` cannot be served (None: it can)."""
        if self.matryoshka_dimensions is None:
            return "this model does not support matryoshka representations: dimensions cannot be set"
        if not 1 <= dimensions <= hidden_size:
            return f"dimensions must be between 1 and the model's hidden size {hidden_size}; got {dimensions}"
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            return f"dimensions must be one of {self.matryoshka_dimensions}; got {dimensions}"
        return None


def _sentence_transformers_pooling(model_dir: str) -> dict:
    """pooling_type and normalize from a sentence-transformers model's modules.json and its Pooling
    module's config.json; {} when the directory has none."""
    try:
        with open(os.path.join(model_dir, "modules.json")) as f:
            modules = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    found: dict = {"normalize": any(m.get("type", "").endswith("Normalize") for m in modules)}
    for module in modules:
        if module.get("type", "").endswith("Pooling"):
            try:
                with open(os.path.join(model_dir, module.get("path", ""), "config.json")) as f:
                    pooling = json.load(f)
            except (OSError, json.JSONDecodeError):
                continue
            for key, pooling_type in _ST_MODES.items():
                if pooling.get(key):
                    found["pooling_type"] = pooling_type
                    break
    return found


def score_pairs(text_1, text_2) -> list[tuple[object, object]]:
    """vLLM's pairing for score / rerank: one against one, one against many, or many against as
    many (pairwise). Each side is a text (or prompt) or a list of them."""
    first = list(text_1) if isinstance(text_1, (list, tuple)) else [text_1]
    second = list(text_2) if isinstance(text_2, (list, tuple)) else [text_2]
    if not first or not second:
        raise ValueError("score needs at least one text on each side.")
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise ValueError(f"score pairs the texts one to one: got {len(first)} and {len(second)}.")
    return list(zip(first, second))


def cosine_similarity(a: list[float], b: list[float]) -> float:
    """The score of an embedding model for a pair: the cosine of its two embeddings."""
    dot = sum(x * y for x, y in zip(a, b))
    norm = (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5
    return dot / norm if norm else 0.0


def is_classifier(hf_config) -> bool:
    """A model with a classification head (`*ForSequenceClassification`): it scores, it does not generate."""
    return any(a.endswith("ForSequenceClassification") for a in getattr(hf_config, "architectures", None) or [])


def classifier_activation(logits: list[float]) -> list[float]:
    """A classifier's probabilities, as vLLM and sentence-transformers' CrossEncoder give them: the
    sigmoid of a single logit (a reranker's relevance), the softmax of several (one per label)."""
    if len(logits) == 1:
        x = logits[0]
        return [1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]
