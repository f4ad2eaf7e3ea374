"""Loading a Hugging Face checkpoint into a model built for one rank (models/llama.py and the models
built on it): each tensor is copied into the parameter of its name, q/k/v and gate/up into their
stacked matrices shard by shard, tensors of other pipeline stages skipped, quantized linears given
what their method loads itself; every parameter must be filled, and the error names what is
missing or has no place."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

# checkpoint projection name -> (fused module name, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class CheckpointLoading:
    """A mixin of the causal-LM classes (LlamaForCausalLM): `self.model` is the decoder stack, with
    its pipeline stage (`layer_range`, `is_first_stage`, `is_last_stage`)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy in the checkpoint tensors (Hugging Face names) this rank holds a share of; every
        parameter must be filled."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        missing = {key for name in params for key in self._load_keys(name)}
        for name, tensor in weights:
            for target, shard in self._targets(name):
                module_name, _, suffix = target.rpartition(".")
                module = modules.get(module_name)
                if module is None or not _takes(module, suffix):
                    if self._on_other_rank(target):
                        continue
                    raise ValueError(f"Checkpoint tensor {name!r} has no place in {type(self).__name__}.")
                filled = None
                if hasattr(module, "load_checkpoint_tensor"):
                    filled = module.load_checkpoint_tensor(suffix, shard, tensor)
                else:
                    _copy_checked(params[target].data, tensor, name)
                if filled is not None:  # the pieces it filled (mixture-of-experts layers: per expert)
                    missing.difference_update(f"{target}#{s}" for s in filled)
                else:
                    missing.discard(target if shard is None else f"{target}#{shard}")
        if missing:
            raise ValueError(f"The checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}.")

    def _targets(self, name: str) -> list[tuple[str, int | None]]:
        """Where a checkpoint tensor goes on this rank: nowhere (rotary tables; a tied head), the
        parameter of its name (q/k/v and gate/up into their stacked matrix), or, on the last stage
        of a pipeline whose embeddings are tied, the embedding into the head."""
        if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
            return []
        if name == "model.embed_tokens.weight" and self.tie_word_embeddings and hasattr(self, "lm_head"):
            return [("lm_head.weight", None)] + ([(name, None)] if self.model.is_first_stage else [])
        return [target_name(name)]

    def _on_other_rank(self, target: str) -> bool:
        """A parameter that exists in the model, but on another pipeline stage."""
        parts = target.split(".")
        if target.startswith("model.layers."):
            return int(parts[2]) not in self.model.layer_range
        if target.startswith("model.embed_tokens."):
            return not self.model.is_first_stage
        return (target.startswith("model.norm.") or target.startswith("lm_head.")) and not self.model.is_last_stage

    def process_weights_after_loading(self) -> None:
        """Let quantized linears turn what they loaded into their kernels' form."""
        for module in self.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)

    def _owner(self, param_name: str) -> nn.Module:
        return self.get_submodule(param_name.rsplit(".", 1)[0])

    def _load_keys(self, param_name: str) -> list[str]:
        """A stacked parameter (q/k/v, gate/up) is filled shard by shard: one key per shard; a module
        that says which pieces of a parameter the checkpoint fills (checkpoint_shards) names them."""
        owner = self._owner(param_name)
        if hasattr(owner, "checkpoint_shards"):
            return [f"{param_name}#{s}" for s in owner.checkpoint_shards(param_name.rsplit(".", 1)[1])]
        shards = len(getattr(owner, "output_sizes", [None]))
        return [param_name] if shards == 1 else [f"{param_name}#{s}" for s in range(shards)]


def _takes(module: nn.Module, name: str) -> bool:
    """Whether `module` has a place for its checkpoint tensor `name`: a parameter, or a tensor its
    quantized method loads itself (AWQ's qweight ...), or one it names (a mixture-of-experts layer's
    quantized experts: `checkpoint_tensor_names`)."""
    method = getattr(module, "quant_method", None)
    if isinstance(getattr(module, name, None), nn.Parameter) or name in getattr(module, "checkpoint_tensor_names", ()):
        return True
    return method is not None and method.takes(name)


def _copy_checked(dest: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if dest.shape != tensor.shape:
        raise ValueError(f"Checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}.")
    dest.copy_(tensor)


def target_name(name: str) -> tuple[str, int | None]:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _STACKED:
            fused, shard = _STACKED[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard
    return name, None
