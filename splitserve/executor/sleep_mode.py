"""Sleep mode on a rank (vLLM's LLM.sleep / wake_up, for reinforcement-learning loops that hand the
accelerator to a trainer between rollouts): what one rank's model runner releases and takes back.

- level 1: the KV cache (and the host swap space) is released, a draft model's too; on a GPU the
  weights (a draft model's too) move to host memory (on a CPU they already are there, and stay).
  Waking moves them back and allocates a new, empty KV cache.
- level 2: the runner itself is dropped, weights and all; waking builds it again, which reads the
  weights from the model's files (dummy weights are drawn again from the same seed).

CUDA graphs hold the KV cache's addresses: they are dropped with it and captured again after
waking (the executor's capture_cuda_graphs)."""

from __future__ import annotations

import gc
import logging

import torch

logger = logging.getLogger(__name__)


def release_kv_cache(runner) -> None:
    for layer in _attention_layers(runner):
        layer.kv_cache = None
        layer.kv_scales = None
    if runner.draft is not None:  # speculative decoding's draft model: its KV and what it knew of requests
        runner.draft.decode_stack = None
        runner.draft.tokens.clear()
        runner.draft.computed.clear()
    runner.kv_caches, runner.kv_scales = [], None
    runner.swap = None
    runner.graph_runner = None
    runner.decode_stack = None
    runner.requests.clear()


def offload_weights(runner) -> None:
    """Parameters and buffers to pinned host memory (a GPU runner); nothing on a CPU."""
    if runner.device.type != "cuda":
        return
    for tensor in _tensors(runner):
        tensor.data = tensor.data.to("cpu").pin_memory()


def reload_weights(runner) -> None:
    if runner.device.type != "cuda":
        return
    for tensor in _tensors(runner):
        tensor.data = tensor.data.to(runner.device, non_blocking=True)
    torch.cuda.synchronize(runner.device)


def _attention_layers(runner):
    yield from runner.model.attention_layers()
    if runner.draft is not None:
        yield from runner.draft.model.attention_layers()


def _tensors(runner):
    """The weights of the runner's model, and of its draft model if it has one."""
    for model in (runner.model, runner.draft.model if runner.draft is not None else None):
        if model is not None:
            yield from model.parameters()
            yield from model.buffers()


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class RankSleep:
    """A rank's side of sleep mode, around its runner (None while asleep at level 2)."""

    def __init__(self, make_runner, model_config=None):
        self.make_runner = make_runner  # builds a new ModelRunner (level 2's wake-up)
        self.model_config = model_config  # what make_runner reads the weights from
        self.level = 0
        self.offload = None  # while asleep: the KV offloading tier's copier (kv_tier/copier.py), rebound on waking

    def sleep(self, runner, level: int):
        """Returns the runner to keep (None at level 2)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if runner is None:  # already dropped (a failed wake-up with new weights): nothing to release
            self.level = 2
            return None
        device = runner.device
        self.offload = runner.offload  # the KV offloading tier's host memory and disk writer stay
        if self.offload is not None:
            self.offload.close()  # its queued disk writes read the cache that goes now
            self.offload.rebind([], None)
            runner.offload = None
        release_kv_cache(runner)
        if level == 1:
            offload_weights(runner)
        else:
            runner = None
        free_memory(device)
        self.level = level
        return runner

    def wake_up(self, runner, num_blocks: int, num_cpu_blocks: int, weights=None):
        """Returns the runner, its weights on the device and a new KV cache allocated. `weights`
        (path, load format), after level 2: the checkpoint to build the runner from from now on."""
        if weights is not None:
            if runner is not None:
                raise ValueError("New weights are read only by a runner built again (after sleep level 2).")
            self.model_config.model, self.model_config.load_format = weights
        if self.level == 2 or runner is None:
            runner = self.make_runner()
        else:
            reload_weights(runner)
        runner.initialize_kv_cache(num_blocks, num_cpu_blocks)  # an offloading tier: a stand-in with no host blocks
        if self.offload is not None:
            runner.offload, self.offload = self.offload.rebind(runner.kv_caches, runner.kv_scales), None
        self.level = 0
        return runner
