"""transformers' own model on the same source as splitserve's: the baseline of `bench throughput`
and the model the quantize tool calibrates."""

from __future__ import annotations

import contextlib
import functools


def load_hf_model(directory: str, gguf_file: str | None, dtype, config=None):
    """transformers' model on the same weights; a GGUF file is dequantized to dense weights, as
    splitserve does, so that both sides run the same dense matmuls. `config`: the model's config as
    splitserve read it (loader/resolve.py), so that transformers does not read a GGUF file's
    metadata a second time (4-5 s for the default model's 49,152-token vocabulary)."""
    from transformers import AutoModelForCausalLM

    from splitserve.loader.config_cache import as_transformers_config

    kwargs = {} if config is None else {"config": as_transformers_config(config)}
    if gguf_file is not None:
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(gguf_file=gguf_file, dequantize=True)
    from splitserve.loader.gguf_cache import gguf_parsed_once

    with gguf_name_maps_built_once(), gguf_parsed_once():  # without `config`, the file is read twice
        return AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=dtype, **kwargs).eval()


@contextlib.contextmanager
def gguf_name_maps_built_once():
    """transformers maps a GGUF file's tensor names to the model's by walking every submodule, and
    at each one builds gguf's TensorNameMap (every architecture's names for every block) anew: 397
    times, 9-10 s, for the default model. The map depends only on (architecture, blocks): within
    this block it is built once per pair. The maps are only read (`get_name`)."""
    try:
        import gguf
    except ImportError:
        yield
        return
    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def dummy_hf_model(hf_config, dtype, seed: int, device):
    """transformers' model of the same config with random weights (load_format="dummy"): built with
    `from_config` and filled as splitserve fills its own (uniform in +-1e-3, seeded), so both sides
    run the same shapes on values of the same scale (not the same values: the layouts differ)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from splitserve.loader.config_cache import as_transformers_config
    from splitserve.loader.weights import fill_dummy

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(as_transformers_config(hf_config)), dtype=dtype)
    fill_dummy(model, seed)
    return model.eval()
