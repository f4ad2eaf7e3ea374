"""Built-in configs of well-known models (load_format="dummy" with no download): every config loads
through transformers and builds splitserve's model class with the published parameter count (on the
meta device: no memory, no forward); the resolution rules; the stand-in tokenizer's end-of-sequence
ids; the benchmark's workload flags and its transformers baseline with random weights."""

from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace

import pytest
import torch

from splitserve.engine.arg_utils import EngineArgs
from splitserve.loader import known_configs
from splitserve.loader.resolve import DEFAULT_MODEL_HUB_ID, default_model_path, load_model_config
from splitserve.models.registry import get_model_class

CPU = torch.device("cpu")

# Parameter counts (embeddings included, tied ones once) as the model cards give them.
PUBLISHED_PARAMS = {
    "Qwen/Qwen3-0.6B": 0.596e9,  # 0.6B on the card; 596M with the tied embedding counted once
    "Qwen/Qwen3-8B": 8.2e9,
    "meta-llama/Llama-3.2-1B": 1.24e9,
    "meta-llama/Llama-3.2-1B-Instruct": 1.24e9,
    "meta-llama/Llama-3.1-8B": 8.03e9,
    "meta-llama/Llama-3.1-8B-Instruct": 8.03e9,
    "Qwen/Qwen2.5-7B": 7.61e9,
    "Qwen/Qwen2.5-7B-Instruct": 7.61e9,
    "Qwen/Qwen2.5-0.5B-Instruct": 0.49e9,
    "HuggingFaceTB/SmolLM2-135M-Instruct": 135e6,
    # Mixture-of-experts: every expert counted, not only the active ones
    "ibm-granite/granite-3.0-1b-a400m-instruct": 1.33e9,
    "Qwen/Qwen3-30B-A3B": 30.5e9,
    # Vision-language: the vision tower (675M) included
    "Qwen/Qwen2-VL-2B-Instruct": 2.21e9,
}


@pytest.fixture
def empty_hf_cache(tmp_path, monkeypatch):
    """A Hugging Face cache with nothing in it (conftest sets HF_HUB_OFFLINE=1: no hub access)."""
    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    return cache


def _dummy(model: str, **kw):
    return load_model_config(EngineArgs(model=model, load_format="dummy", **kw), CPU)


def _tiny_config_dir(directory, tokenizer=None) -> str:
    import transformers

    os.makedirs(directory, exist_ok=True)
    transformers.Qwen3Config(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    ).save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return str(directory)


def test_the_asked_for_models_are_built_in():
    assert set(known_configs.builtin_model_ids()) == set(PUBLISHED_PARAMS)
    for model_id in PUBLISHED_PARAMS:
        path = known_configs.builtin_config_path(model_id)
        assert os.path.basename(path) == model_id.replace("/", "--") + ".json"


@pytest.mark.parametrize("model_id", sorted(PUBLISHED_PARAMS))
def test_builtin_config_builds_the_published_model(model_id):
    from transformers import AutoConfig

    path = known_configs.builtin_config_path(model_id)
    with open(path) as f:
        raw = json.load(f)
    config = AutoConfig.from_pretrained(path)
    assert (
        type(config).__name__
        == {
            "llama": "LlamaConfig",
            "qwen2": "Qwen2Config",
            "qwen3": "Qwen3Config",
            "granitemoe": "GraniteMoeConfig",
            "qwen3_moe": "Qwen3MoeConfig",
            "qwen2_vl": "Qwen2VLConfig",
        }[raw["model_type"]]
    )
    assert raw["torch_dtype"] == "bfloat16" and config.dtype == torch.bfloat16
    cls = get_model_class(config)
    with torch.device("meta"):
        model = cls(config, torch.bfloat16, 4096)
    params = sum(p.numel() for p in model.parameters())
    assert params == pytest.approx(PUBLISHED_PARAMS[model_id], rel=0.02), f"{model_id}: {params / 1e6:.1f}M"


def test_architecture_details():
    qwen3 = known_configs.load_builtin_config("Qwen/Qwen3-0.6B")
    assert (
        qwen3.hidden_size,
        qwen3.intermediate_size,
        qwen3.num_hidden_layers,
        qwen3.num_attention_heads,
        qwen3.num_key_value_heads,
        qwen3.head_dim,
        qwen3.vocab_size,
    ) == (1024, 3072, 28, 16, 8, 128, 151936)
    assert qwen3.tie_word_embeddings and qwen3.max_position_embeddings == 40960
    assert qwen3.rope_parameters["rope_theta"] == 1000000 and qwen3.eos_token_id == 151645

    llama = known_configs.load_builtin_config("meta-llama/Llama-3.2-1B")
    rope = llama.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500000.0
    assert (
        rope["factor"],
        rope["low_freq_factor"],
        rope["high_freq_factor"],
        rope["original_max_position_embeddings"],
    ) == (32.0, 1.0, 4.0, 8192)
    assert (llama.hidden_size, llama.head_dim, llama.num_key_value_heads, llama.vocab_size) == (2048, 64, 8, 128256)
    assert llama.tie_word_embeddings and llama.eos_token_id == 128001
    assert known_configs.load_builtin_config("meta-llama/Llama-3.2-1B-Instruct").eos_token_id == [
        128001,
        128008,
        128009,
    ]
    assert known_configs.load_builtin_config("meta-llama/Llama-3.1-8B").rope_parameters["factor"] == 8.0

    qwen25 = known_configs.load_builtin_config("Qwen/Qwen2.5-7B")
    assert (qwen25.hidden_size, qwen25.intermediate_size, qwen25.num_key_value_heads, qwen25.vocab_size) == (
        3584,
        18944,
        4,
        152064,
    )
    assert not qwen25.tie_word_embeddings and not qwen25.use_sliding_window
    assert known_configs.load_builtin_config("Qwen/Qwen2.5-7B-Instruct").max_position_embeddings == 32768


def test_builtin_config_with_dummy_weights(empty_hf_cache, caplog):
    with caplog.at_level(logging.INFO, logger="splitserve.loader.resolve"):
        config = _dummy("Qwen/Qwen3-0.6B")
    assert "no weights or hub access needed: using splitserve's built-in config of Qwen/Qwen3-0.6B" in caplog.text
    assert "Tokenizer of Qwen/Qwen3-0.6B" in caplog.text
    assert config.model == known_configs.builtin_config_path("Qwen/Qwen3-0.6B")
    assert config.served_model_name == "Qwen/Qwen3-0.6B" and config.load_format == "dummy"
    assert config.dtype == torch.bfloat16 and config.max_model_len == 40960 and config.vocab_size == 151936
    # No tokenizer is carried: the embedded SmolLM2 one stands in, for text in and out only.
    assert config.tokenizer == default_model_path() and config.substitute_tokenizer
    # Hub ids match case-insensitively, as on the hub; the config's own spelling is used.
    assert _dummy("qwen/qwen3-0.6b", max_model_len=128).hf_config.hidden_size == 1024


def test_embedded_default_model_keeps_its_own_tokenizer(empty_hf_cache):
    config = _dummy(DEFAULT_MODEL_HUB_ID)
    assert config.tokenizer == default_model_path() and not config.substitute_tokenizer


def test_builtin_config_only_with_dummy(empty_hf_cache):
    with pytest.raises(FileNotFoundError, match="Qwen/Qwen3-0.6B"):
        load_model_config(EngineArgs(model="Qwen/Qwen3-0.6B"), CPU)


def test_unknown_hub_id_with_dummy_names_the_builtins(empty_hf_cache):
    with pytest.raises(ValueError) as info:
        _dummy("no-such-org/no-such-model")
    message = str(info.value)
    assert "no-such-org/no-such-model" in message
    for model_id in PUBLISHED_PARAMS:
        assert model_id in message


def test_local_directory_wins(tmp_path, monkeypatch, empty_hf_cache, smollm_tokenizer):
    # A directory that happens to be spelled like a built-in hub id is what the user means.
    monkeypatch.chdir(tmp_path)
    _tiny_config_dir(tmp_path / "Qwen" / "Qwen3-0.6B")
    config = _dummy("Qwen/Qwen3-0.6B")
    assert config.hf_config.hidden_size == 64 and config.model == "Qwen/Qwen3-0.6B"
    assert config.tokenizer == default_model_path() and config.substitute_tokenizer  # it has no tokenizer
    with_tokenizer = _tiny_config_dir(tmp_path / "with_tokenizer", smollm_tokenizer)
    config = _dummy(with_tokenizer)
    assert config.tokenizer == with_tokenizer and not config.substitute_tokenizer


def test_local_hf_cache_wins(tmp_path, empty_hf_cache):
    repo = empty_hf_cache / "models--Qwen--Qwen3-0.6B"
    _tiny_config_dir(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    config = _dummy("Qwen/Qwen3-0.6B")
    assert config.hf_config.hidden_size == 64 and config.model.endswith(os.path.join("snapshots", "abc123"))


def test_stand_in_tokenizer_takes_end_of_sequence_from_the_config(empty_hf_cache):
    from splitserve.engine.processor import Processor

    smollm_like = SimpleNamespace(eos_token_id=2)
    processor = Processor(_dummy("meta-llama/Llama-3.2-1B-Instruct", max_model_len=64), smollm_like)
    assert processor.eos_token_id == 128001 and processor.extra_eos_ids == {128008, 128009}
    processor = Processor(_dummy("Qwen/Qwen3-0.6B", max_model_len=64), smollm_like)
    assert processor.eos_token_id == 151645 and processor.extra_eos_ids == set()
    processor = Processor(_dummy(DEFAULT_MODEL_HUB_ID, max_model_len=64), smollm_like)
    assert processor.eos_token_id == 2  # its own tokenizer


@pytest.mark.slow  # the default model's full-size architecture (~12 s)
def test_dummy_builtin_model_generates_text(empty_hf_cache):
    from splitserve import LLM, SamplingParams

    llm = LLM(model=DEFAULT_MODEL_HUB_ID, load_format="dummy", max_model_len=64, use_tqdm_on_load=False)
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=0)
    out = llm.generate(["Hello, my name is", {"prompt_token_ids": [5, 900, 49151]}], params, use_tqdm=False)
    assert len(llm.get_tokenizer()) == 49152  # its own tokenizer: every id it generates has a text
    for request in out:
        completion = request.outputs[0]
        assert len(completion.token_ids) == 6 and all(0 <= t < 49152 for t in completion.token_ids)
        assert isinstance(completion.text, str) and completion.text


def test_nano_vllm_workload_flags():
    from splitserve.benchmarks import throughput
    from splitserve.engine.arg_flags import engine_args_from
    from splitserve.entrypoints.cli import build_parser

    argv = (
        "bench throughput --model Qwen/Qwen3-0.6B --load-format dummy --num-prompts 256 --min-input-len 100 "
        "--max-input-len 1024 --min-output-len 100 --max-output-len 1024 --seed 0"
    ).split()
    ns = build_parser().parse_args(argv)
    args = engine_args_from(ns)
    assert args.load_format == "dummy" and args.seed == 0
    workload = throughput.make_workload(ns, 151936, set())
    assert len(workload.prompts) == 256
    assert all(100 <= len(p) <= 1024 for p in workload.prompts)
    assert all(100 <= n <= 1024 for n in workload.output_lens)
    assert throughput.make_workload(ns, 151936, set()) == workload  # the seed fixes it
    fitted = throughput.fit_max_model_len(args, workload, 40960)
    assert fitted.max_model_len == max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens))
    assert throughput.fit_max_model_len(EngineArgs(max_model_len=4096), workload, 40960).max_model_len == 4096


def test_transformers_baseline_with_dummy_weights():
    import transformers

    from splitserve.benchmarks.throughput import _hf_generate
    from splitserve.loader.hf_model import dummy_hf_model

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = dummy_hf_model(config, torch.float32, 0, CPU)
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert all(p.abs().max() <= 1e-3 and p.dtype == torch.float32 for p in model.parameters())
    out = _hf_generate(model, [[1, 2, 3], [4, 5]], 3, 0, 1.0)
    assert out.shape == (2, 6)


@pytest.mark.slow  # runs two engines
def test_throughput_benchmark_runs_both_backends_on_dummy_weights(tmp_path, smollm_tokenizer, capsys):
    from splitserve.benchmarks import throughput
    from splitserve.entrypoints.cli import build_parser, engine_args_from

    model = _tiny_config_dir(tmp_path / "tiny", smollm_tokenizer)
    argv = [
        "bench",
        "throughput",
        "--model",
        model,
        "--load-format",
        "dummy",
        "--dtype",
        "float32",
        "--num-prompts",
        "3",
        "--min-input-len",
        "4",
        "--max-input-len",
        "9",
        "--min-output-len",
        "2",
        "--max-output-len",
        "5",
        "--backend",
        "splitserve",
        "hf",
        "--no-use-tqdm-on-load",
        "--profile",
        str(tmp_path / "profile"),
    ]
    ns = build_parser().parse_args(argv)
    results = throughput.main(ns, engine_args_from(ns))
    assert [r.backend for r in results] == ["splitserve", "hf"]
    assert results[0].output_tokens == results[1].output_tokens
    out = capsys.readouterr().out
    assert "random weights" in out
    # --profile: splitserve's run under torch.profiler, a summary and a Chrome trace
    assert "Profiled run:" in out and "Self CPU time total" in out
    assert "where the time went" in out and "matmuls" in out and "outside operators" in out  # the CPU breakdown
    (trace,) = (tmp_path / "profile").iterdir()
    assert trace.name.endswith(".json") and trace.stat().st_size > 0
    # and the host's time per engine step by phase (splitserve/step_timing.py)
    breakdown = out[out.index("Host time per engine step") :]
    for phase in ("scheduling", "input preparation", "forward", "sampling", "update", "output processing"):
        (line,) = [line for line in breakdown.splitlines() if line.startswith(phase + " ")]
        assert float(line.split()[-3]) > 0, line  # ms per step


def test_the_cpu_breakdown_sorts_operators_into_categories():
    from splitserve.benchmarks.profiling import categorize, cpu_breakdown

    assert categorize("aten::addmm") == categorize("mkldnn::_linear_pointwise") == "matmuls"
    assert categorize("aten::_weight_int8pack_mm") == categorize("splitserve_cpu::gguf_mm") == "matmuls"
    assert categorize("splitserve_cpu::decode_attention") == "attention"
    assert categorize("splitserve_cpu::write_kv") == "KV-cache writes"
    assert categorize("splitserve_cpu::add_rms_norm") == "norms and rotary"
    assert categorize("splitserve_cpu::decode_stack_forward").startswith("fused layer stack")
    assert categorize("aten::empty_strided") == categorize("aten::clamp_min") == "other operators"
    table = cpu_breakdown({"aten::addmm": 2.0, "splitserve_cpu::rotary": 0.5, "aten::copy_": 0.5}, wall=4.0)
    lines = table.splitlines()
    assert lines[1].startswith("matmuls") and lines[1].endswith("50.0%")
    assert any(line.startswith("outside operators") and line.endswith("25.0%") for line in lines)


def test_busy_seconds_is_the_union_of_intervals():
    from splitserve.benchmarks.profiling import busy_seconds

    assert busy_seconds([]) == 0
    assert busy_seconds([(0, 2), (1, 3), (5, 6), (5.5, 5.7), (2.5, 2.6)]) == 4


def test_the_default_model_is_served_under_its_name_however_given(tmp_path):
    from splitserve.loader.resolve import DEFAULT_MODEL_NAME, _served_name

    path = default_model_path()
    assert _served_name(None, path) == DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"
    assert _served_name(path, path) == DEFAULT_MODEL_NAME  # not the path inside site-packages
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    assert _served_name(str(other), str(other)) == str(other)  # any other model: as given, as vLLM does
