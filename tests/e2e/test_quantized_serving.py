"""`splitserve serve` with quantized weights and a quantized KV cache: an AWQ checkpoint served
with an int8 KV cache answers exactly as the same engine offline."""

from __future__ import annotations

import httpx
import pytest

from splitserve import LLM, SamplingParams
from tests.helpers.quant_layouts import write_quantized_checkpoint
from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow  # starts servers

ARGS = ["--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "64", "--kv-cache-dtype", "int8"]


def test_awq_checkpoint_served_with_int8_kv_cache(tiny_models, tmp_path):
    path = str(tmp_path / "awq")
    write_quantized_checkpoint(tiny_models["llama"], path, "awq")
    prompt = [5, 17, 300, 42, 7, 99, 512, 3]
    offline = LLM(
        path,
        dtype="float32",
        max_model_len=256,
        num_gpu_blocks_override=64,
        kv_cache_dtype="int8",
        use_tqdm_on_load=False,
    )
    expected = offline.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    with RemoteServer(path, *ARGS, "--quantization", "awq") as server:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert reply["choices"][0]["token_ids"] == list(expected[0].outputs[0].token_ids)


def test_contradicting_quantization_flag_stops_the_server(tiny_models, tmp_path):
    path = str(tmp_path / "awq")
    write_quantized_checkpoint(tiny_models["llama"], path, "awq")
    with pytest.raises(RuntimeError, match="exited"):
        RemoteServer(path, *ARGS, "--quantization", "gptq", startup_timeout=60).close()
