"""A request's default sampling from the model's generation config (loader/generation_config.py,
vLLM's --generation-config / --override-generation-config), and how the OpenAI requests and the
offline API take it: only the fields a request leaves unset."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from splitserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.loader.generation_config import describe, sampling_defaults
from splitserve.loader.resolve import default_model_path


def _config(model: str, mode: str = "auto", override: dict | None = None):
    return SimpleNamespace(model=model, generation_config=mode, override_generation_config=override)


def _write(directory, **fields) -> str:
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "do_sample": True, **fields}))
    return str(directory)


def test_a_checkpoints_generation_config(tmp_path):
    model = _write(tmp_path, temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=300, repetition_penalty=1.1)
    assert sampling_defaults(_config(model)) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "max_tokens": 300,
        "repetition_penalty": 1.1,
    }
    assert sampling_defaults(_config(model, "vllm")) == {}
    override = sampling_defaults(_config(model, override={"temperature": 0.1, "min_p": 0.05}))
    assert (override["temperature"], override["min_p"], override["top_k"]) == (0.1, 0.05, 20)
    assert sampling_defaults(_config(model, "vllm", {"temperature": 0.3})) == {"temperature": 0.3}


def test_a_directory_given_as_the_mode(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "gen").mkdir()
    model, gen = str(tmp_path / "model"), _write(tmp_path / "gen", temperature=0.4)
    assert sampling_defaults(_config(model)) == {}  # the model has no generation_config.json
    assert sampling_defaults(_config(model, gen)) == {"temperature": 0.4}
    with pytest.raises(ValueError, match="'auto', 'vllm' or a directory holding generation_config.json"):
        sampling_defaults(_config(model, model))


@pytest.mark.parametrize(
    "fields, message",
    [({"temperature": "hot"}, "temperature must be a number"), ({"top_p": 0.0}, "top_p must be in")],
)
def test_bad_values_are_refused_at_start_up(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        sampling_defaults(_config(_write(tmp_path, **fields)))


def test_the_embedded_default_model_ships_its_authors_values():
    """SmolLM2's authors recommend temperature 0.2 and top_p 0.9; the .gguf file carries none."""
    assert sampling_defaults(_config(default_model_path())) == {"temperature": 0.2, "top_p": 0.9}
    assert "temperature=0.2, top_p=0.9" in describe({"temperature": 0.2, "top_p": 0.9})


def test_a_gguf_files_sampling_keys(tmp_path):
    import gguf

    path = str(tmp_path / "m.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_float32("general.sampling.temp", 0.7)
    writer.add_uint32("general.sampling.top_k", 40)
    writer.add_float32("general.sampling.top_p", 0.8)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    found = sampling_defaults(_config(path))
    assert found == {"temperature": pytest.approx(0.7), "top_k": 40, "top_p": pytest.approx(0.8)}


DEFAULTS = {"temperature": 0.2, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}


def test_requests_take_the_defaults_only_where_they_leave_a_field_unset():
    unset = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]).to_sampling_params(None, DEFAULTS)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.repetition_penalty) == (0.2, 0.9, 20, 1.05)
    own = CompletionRequest(prompt="x", temperature=0, top_p=1.0, top_k=-1).to_sampling_params(None, DEFAULTS)
    assert (own.temperature, own.top_p, own.top_k, own.repetition_penalty) == (0.0, 1.0, 0, 1.05)
    null = CompletionRequest(prompt="x", temperature=None).to_sampling_params(None, DEFAULTS)
    assert null.temperature == 0.2  # an explicit null is unset
    plain = CompletionRequest(prompt="x").to_sampling_params(None, None)
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)
    beam = CompletionRequest(prompt="x", use_beam_search=True, n=2, temperature=0).to_sampling_params(None, DEFAULTS)
    assert (beam.top_p, beam.top_k) == (1.0, 0)  # a beam search does not sample: no defaults


def test_default_max_tokens():
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert chat.to_sampling_params(16).max_tokens == 16  # FastDeploy's entry point
    assert chat.to_sampling_params(None).max_tokens is None  # vLLM's: the rest of the context
    assert (
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=40)
        .to_sampling_params(16)
        .max_tokens
        == 40
    )
    assert CompletionRequest(prompt="x").to_sampling_params(100).max_tokens == 16  # OpenAI's completions default
    assert CompletionRequest(prompt="x", max_tokens=None).to_sampling_params(100).max_tokens == 100


def test_entry_points_default_max_tokens():
    from splitserve.entrypoints.openai.api_server import FASTDEPLOY_DEFAULT_MAX_TOKENS
    from splitserve.entrypoints.openai.args import make_arg_parser, split_args

    assert split_args(make_arg_parser().parse_args([]))[1].default_max_tokens is None
    fastdeploy = make_arg_parser(default_max_tokens=FASTDEPLOY_DEFAULT_MAX_TOKENS)
    assert FASTDEPLOY_DEFAULT_MAX_TOKENS == 16
    assert split_args(fastdeploy.parse_args([]))[1].default_max_tokens == 16
    assert split_args(fastdeploy.parse_args(["--default-max-tokens", "64"]))[1].default_max_tokens == 64
    with pytest.raises(ValueError, match="--default-max-tokens must be >= 1"):
        split_args(fastdeploy.parse_args(["--default-max-tokens", "0"]))


def test_engine_config_and_offline_defaults():
    """create_engine_config resolves the defaults once (the server and LLM read them from it);
    LLM.generate without sampling_params uses them, as vLLM's get_default_sampling_params does."""
    from splitserve.engine.arg_utils import EngineArgs
    from splitserve.entrypoints.llm import LLM

    config = EngineArgs().create_engine_config()
    assert config.model_config.sampling_defaults == {"temperature": 0.2, "top_p": 0.9}
    assert EngineArgs(generation_config="vllm").create_engine_config().model_config.sampling_defaults == {}
    llm = object.__new__(LLM)  # the engine itself is not needed to pick the params
    llm.llm_engine = SimpleNamespace(config=config)
    params = llm._params_list(None, 2)
    assert [(p.temperature, p.top_p, p.max_tokens) for p in params] == [(0.2, 0.9, 16)] * 2
