"""The model runner's LoRA adapters: read from disk into a host cache (up to max_cpu_loras, least
recently used out first), put into one of max_loras device slots when a step needs them, and the
step's runs of tokens per adapter handed to every LoRA layer (layers/lora.py).

The scheduler never puts more than max_loras adapters in one step, so a step always finds slots:
an adapter already in a slot stays there, the others take slots that this step does not use.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from splitserve.config import LoRAConfig
from splitserve.layers.basic import Linear
from splitserve.layers.lora import LoRABatchContext, LoRASlots
from splitserve.lora.peft import BaseModelShapes, LoRAModel, load_lora_model
from splitserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model, hf_config, config: LoRAConfig, device: torch.device, dtype: torch.dtype):
        self.model, self.config, self.dtype = model, config, dtype
        self.shapes = BaseModelShapes.from_hf_config(hf_config)
        self.context = LoRABatchContext()
        self.layers: dict[str, Linear] = {}
        for name, module in model.named_modules():
            if isinstance(module, Linear) and name.startswith("model.layers."):
                module.lora = LoRASlots(module, config.max_loras, config.max_lora_rank, self.context, device)
                self.layers[name] = module
        self.host_cache: OrderedDict[int, LoRAModel] = OrderedDict()  # lora_int_id -> weights, LRU first
        self.slots: list[int | None] = [None] * config.max_loras  # lora_int_id held by each slot
        self.slot_used: list[int] = [0] * config.max_loras  # step count of last use, for eviction

    # --- adapters ------------------------------------------------------------------------------
    def add_adapter(self, lora: LoRARequest) -> LoRAModel:
        """The adapter's weights, read from disk unless the host cache has them."""
        cached = self.host_cache.get(lora.lora_int_id)
        if cached is not None:
            self.host_cache.move_to_end(lora.lora_int_id)
            return cached
        weights = load_lora_model(lora, self.shapes, self.config.max_lora_rank, self.dtype)
        self.host_cache[lora.lora_int_id] = weights
        while len(self.host_cache) > self.config.max_cpu_loras:
            self.host_cache.popitem(last=False)
        logger.info("LoRA adapter %r (id %d) loaded from %s", lora.lora_name, lora.lora_int_id, lora.lora_path)
        return weights

    def remove_adapter(self, lora_int_id: int) -> None:
        """Forget an adapter. A request still running with it reads it from disk again if it must."""
        self.host_cache.pop(lora_int_id, None)
        for slot, held in enumerate(self.slots):
            if held == lora_int_id:
                self._clear(slot)

    # --- one step ------------------------------------------------------------------------------
    def prepare(self, loras: list[LoRARequest | None], query_start_loc: list[int], step: int) -> None:
        """Make the step's adapters resident and set its runs: row i (tokens query_start_loc[i]..
        query_start_loc[i + 1]) runs with loras[i] (None: the base model)."""
        wanted = {lora.lora_int_id: lora for lora in loras if lora is not None}
        if len(wanted) > len(self.slots):
            raise RuntimeError(f"a step with {len(wanted)} LoRA adapters; at most {len(self.slots)} fit (max_loras)")
        slot_of = {held: slot for slot, held in enumerate(self.slots) if held is not None}
        for lora_id, lora in wanted.items():
            if lora_id not in slot_of:
                slot_of[lora_id] = self._activate(lora, set(wanted))
            self.slot_used[slot_of[lora_id]] = step
        segments: list[tuple[int, int, int]] = []
        for row, lora in enumerate(loras):
            if lora is None:
                continue
            start, end, slot = query_start_loc[row], query_start_loc[row + 1], slot_of[lora.lora_int_id]
            if segments and segments[-1][1] == start and segments[-1][2] == slot:
                segments[-1] = (segments[-1][0], end, slot)
            else:
                segments.append((start, end, slot))
        self.context.set_step(segments, query_start_loc[-1])

    def _activate(self, lora: LoRARequest, needed: set[int]) -> int:
        free = [s for s, held in enumerate(self.slots) if held is None or held not in needed]
        slot = min(free, key=lambda s: (self.slots[s] is not None, self.slot_used[s]))
        weights = self.add_adapter(lora)
        shards: dict[str, list] = {}
        for module, pair in weights.modules.items():
            target, shard = self.model.lora_target(module)
            if target not in self.layers:
                continue  # a layer of another pipeline stage
            entry = shards.setdefault(target, [None] * len(self.layers[target].output_sizes))
            entry[shard] = (pair.a, pair.b)
        for name, layer in self.layers.items():
            if name in shards:
                layer.lora.set_slot(slot, shards[name])
            else:
                layer.lora.clear_slot(slot)
        self.slots[slot] = lora.lora_int_id
        return slot

    def _clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.lora.clear_slot(slot)
        self.slots[slot] = None
