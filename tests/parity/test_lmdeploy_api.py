"""The LMDeploy-style API (pipeline, GenerationConfig, PytorchEngineConfig, TurbomindEngineConfig,
Response) runs LMDeploy's documented calls on splitserve's engine and agrees with splitserve.LLM."""

from __future__ import annotations

import math
import threading

import pytest

from splitserve import (
    LLM,
    GenerationConfig,
    PytorchEngineConfig,
    Response,
    SamplingParams,
    TurbomindEngineConfig,
    pipeline,
)

PROMPTS = ["Hi, pls intro yourself", "Shanghai is"]
MAX_NEW = 12


def _backend(**changes) -> PytorchEngineConfig:
    """float32 for exact comparisons; 64 blocks of 64 tokens keep the KV cache tiny."""
    return PytorchEngineConfig(**{"dtype": "float32", "session_len": 256, "num_gpu_blocks": 64, **changes})


def _greedy(**changes) -> GenerationConfig:
    return GenerationConfig(**{"max_new_tokens": MAX_NEW, "ignore_eos": True, **changes})


@pytest.fixture(scope="module")
def model_dir(tiny_chat_model) -> str:
    return tiny_chat_model


@pytest.fixture(scope="module")
def pipe(model_dir):
    with pipeline(model_dir, backend_config=_backend()) as p:
        yield p


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(
        model_dir,
        dtype="float32",
        max_model_len=256,
        block_size=64,
        num_gpu_blocks_override=64,
        enable_prefix_caching=False,
        use_tqdm_on_load=False,
    )


def _rendered_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def _llm_greedy(llm: LLM, prompt, max_tokens: int = MAX_NEW):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


# --- generation ------------------------------------------------------------------------------
def test_greedy_call_matches_llm(pipe, llm):
    responses = pipe(PROMPTS, gen_config=_greedy())
    assert isinstance(responses, list) and len(responses) == 2
    tokenizer = llm.get_tokenizer()
    for i, (prompt, response) in enumerate(zip(PROMPTS, responses)):
        ids = _rendered_ids(tokenizer, [{"role": "user", "content": prompt}])
        expected = _llm_greedy(llm, {"prompt_token_ids": ids})
        assert response.token_ids == expected.token_ids
        assert response.text == expected.text
        assert response.input_token_len == len(ids)
        assert response.generate_token_len == len(response.token_ids) == MAX_NEW
        assert response.finish_reason == "length"
        assert response.index == i
        assert response.logprobs is None


def test_documented_example(pipe):
    """LMDeploy's README call: top_p/top_k/temperature without do_sample, which samples."""

    def run(seed):
        config = GenerationConfig(
            top_p=0.8, top_k=40, temperature=0.8, max_new_tokens=MAX_NEW, ignore_eos=True, random_seed=seed
        )
        return pipe(["Hi, pls intro yourself", "Shanghai is"], gen_config=config)

    responses = run(0)
    assert all(isinstance(r, Response) and r.text for r in responses)
    assert [r.generate_token_len for r in responses] == [MAX_NEW, MAX_NEW]
    assert [r.token_ids for r in responses] != [r.token_ids for r in run(1)]


def test_default_generation_config_is_greedy(pipe):
    """LMDeploy's GenerationConfig() decodes greedily: two calls agree token for token."""
    first = pipe("Hi", gen_config=GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True))
    again = pipe("Hi", gen_config=GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True, random_seed=123))
    assert first.token_ids == again.token_ids == pipe("Hi", gen_config=_greedy(top_k=1)).token_ids


def test_input_shapes(pipe):
    conversation = [{"role": "user", "content": "Hi"}]
    single = pipe("Hi", gen_config=_greedy())
    assert isinstance(single, Response)
    as_list = pipe(["Hi"], gen_config=_greedy())
    assert isinstance(as_list, list) and len(as_list) == 1
    as_conversation = pipe(conversation, gen_config=_greedy())
    assert isinstance(as_conversation, Response)
    conversations = pipe([conversation, [{"role": "user", "content": "Shanghai is"}]], gen_config=_greedy())
    assert [r.index for r in conversations] == [0, 1]
    assert single.token_ids == as_list[0].token_ids == as_conversation.token_ids == conversations[0].token_ids
    assert conversations[1].token_ids == pipe("Shanghai is", gen_config=_greedy()).token_ids


def test_do_preprocess_false_sends_raw_text(pipe, llm):
    raw = pipe("Shanghai is", gen_config=_greedy(), do_preprocess=False)
    expected = _llm_greedy(llm, "Shanghai is")
    assert raw.input_token_len == len(llm.get_tokenizer()("Shanghai is").input_ids)
    assert raw.token_ids == expected.token_ids
    # A conversation is joined as LMDeploy's 'base' template does: its contents, nothing else.
    joined = pipe(
        [{"role": "user", "content": "Shanghai"}, {"role": "user", "content": " is"}],
        gen_config=_greedy(),
        do_preprocess=False,
    )
    assert joined.token_ids == raw.token_ids


def test_gen_config_per_prompt(pipe):
    responses = pipe(PROMPTS, gen_config=[_greedy(max_new_tokens=3), _greedy(max_new_tokens=5)])
    assert [r.generate_token_len for r in responses] == [3, 5]
    with pytest.raises(ValueError, match="2 GenerationConfigs for 1 prompts"):
        pipe(["Hi"], gen_config=[_greedy(), _greedy()])


def test_session_len_bounds_generation(pipe):
    response = pipe("Hi", gen_config=GenerationConfig(max_new_tokens=None, ignore_eos=True))
    assert response.finish_reason == "length"
    assert response.input_token_len + response.generate_token_len == 256


# --- streaming -------------------------------------------------------------------------------
def _collect(stream) -> dict[int, list[Response]]:
    by_prompt: dict[int, list[Response]] = {}
    for response in stream:
        by_prompt.setdefault(response.index, []).append(response)
    return by_prompt


def test_stream_infer_deltas_add_up(pipe):
    final = pipe(PROMPTS, gen_config=_greedy(logprobs=1))
    streamed = _collect(pipe.stream_infer(PROMPTS, gen_config=_greedy(logprobs=1)))
    assert sorted(streamed) == [0, 1]
    for index, whole in enumerate(final):
        parts = streamed[index]
        assert len(parts) == MAX_NEW  # one token per step: a delta each
        assert "".join(p.text for p in parts) == whole.text
        assert [t for p in parts for t in p.token_ids] == whole.token_ids
        assert [lp for p in parts for lp in p.logprobs] == whole.logprobs
        assert [p.generate_token_len for p in parts] == list(range(1, MAX_NEW + 1))
        assert [p.finish_reason for p in parts] == [None] * (MAX_NEW - 1) + ["length"]
        assert all(p.input_token_len == whole.input_token_len for p in parts)


def test_stream_infer_checks_arguments_up_front(pipe):
    with pytest.raises(ValueError, match="n=2"):
        pipe.stream_infer("Hi", gen_config=GenerationConfig(n=2))


def test_closing_a_stream_aborts_its_requests(pipe):
    stream = pipe.stream_infer(PROMPTS, gen_config=_greedy())
    next(stream)
    stream.close()
    assert not pipe.engine.has_unfinished_requests()
    assert not pipe._queues
    assert pipe("Hi", gen_config=_greedy()).generate_token_len == MAX_NEW
    # Closed while the lock is held (as when the garbage collector finalizes it mid-step): no
    # deadlock, and the next call aborts the leftovers before stepping.
    stream = pipe.stream_infer(PROMPTS, gen_config=_greedy())
    next(stream)
    with pipe._lock:
        stream.close()
    assert pipe.engine.has_unfinished_requests()
    assert pipe("Hi", gen_config=_greedy()).generate_token_len == MAX_NEW
    assert not pipe.engine.has_unfinished_requests() and not pipe._queues


def test_interleaved_streams_and_threads_get_their_own_outputs(pipe):
    expected = [r.token_ids for r in pipe(PROMPTS, gen_config=_greedy())]
    # Two generators consumed in turn share the engine's steps.
    a, b = pipe.stream_infer(PROMPTS[0], gen_config=_greedy()), pipe.stream_infer(PROMPTS[1], gen_config=_greedy())
    ids_a, ids_b = [], []
    for ra, rb in zip(a, b):
        ids_a += ra.token_ids
        ids_b += rb.token_ids
    assert [ids_a, ids_b] == expected
    # Two threads calling at once.
    results = [None, None]

    def run(i):
        results[i] = pipe(PROMPTS[i], gen_config=_greedy()).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected


# --- GenerationConfig mapping ----------------------------------------------------------------
def test_generation_config_to_sampling_params():
    # The pipeline document's defaults: max_new_tokens 512, top_p 1.0, top_k 1, temperature 0.8.
    config = GenerationConfig()
    assert (config.max_new_tokens, config.top_p, config.top_k, config.temperature) == (512, 1.0, 1, 0.8)
    default = config.to_sampling_params()
    assert default.temperature == 0.0 and default.max_tokens == 512
    # top_k=1 keeps one token: setting only temperature or top_p stays greedy.
    assert GenerationConfig(temperature=1.2).to_sampling_params().temperature == 0.0
    assert GenerationConfig(top_p=0.5, temperature=0.7).to_sampling_params().temperature == 0.0
    sampled = GenerationConfig(do_sample=True).to_sampling_params()
    assert (sampled.temperature, sampled.top_p, sampled.top_k) == (0.8, 1.0, 50)  # LMDeploy 0.6's top_k
    assert GenerationConfig(do_sample=True, top_k=5).to_sampling_params().top_k == 5
    # LMDeploy's own examples set these without do_sample and expect sampling.
    implied = GenerationConfig(top_p=0.8, top_k=40, temperature=0.8).to_sampling_params()
    assert (implied.temperature, implied.top_p, implied.top_k) == (0.8, 0.8, 40)
    full = GenerationConfig(
        max_new_tokens=7,
        stop_words=["ab"],
        bad_words=["cd"],
        stop_token_ids=[5],
        bad_token_ids=[9],
        random_seed=3,
        min_new_tokens=2,
        logprobs=4,
        min_p=0.1,
        repetition_penalty=1.2,
        ignore_eos=True,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
    ).to_sampling_params()
    assert full.max_tokens == 7 and full.stop == ["ab"] and full.bad_words == ["cd"]
    assert full.stop_token_ids == [5] and full.logit_bias == {9: -math.inf}
    assert (full.seed, full.min_tokens, full.logprobs, full.min_p) == (3, 2, 4, 0.1)
    assert full.repetition_penalty == 1.2 and full.ignore_eos and not full.skip_special_tokens
    assert full.include_stop_str_in_output
    with pytest.raises(ValueError, match="n=2"):
        GenerationConfig(n=2).to_sampling_params()
    with pytest.raises(ValueError, match="bad_token_ids"):
        GenerationConfig(bad_token_ids=["x"]).to_sampling_params()


def test_stop_words_cut_the_text(pipe):
    whole = pipe("Hi", gen_config=_greedy())
    word = next(w for w in whole.text.split()[2:] if len(w) >= 3)
    stopped = pipe("Hi", gen_config=_greedy(stop_words=[word]))
    assert stopped.finish_reason == "stop"
    assert stopped.text == whole.text[: whole.text.index(word)]
    assert stopped.generate_token_len < whole.generate_token_len
    kept = pipe("Hi", gen_config=_greedy(stop_words=[word], include_stop_str_in_output=True))
    assert kept.text == whole.text[: whole.text.index(word) + len(word)]


def test_random_seed_reproducible(pipe):
    def sample(seed):
        config = GenerationConfig(
            max_new_tokens=MAX_NEW, ignore_eos=True, do_sample=True, temperature=1.5, top_k=0, random_seed=seed
        )
        return pipe(PROMPTS, gen_config=config)

    first, again, other = sample(1), sample(1), sample(2)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert [r.token_ids for r in first] != [r.token_ids for r in other]
    greedy = [r.token_ids for r in pipe(PROMPTS, gen_config=_greedy())]
    assert [r.token_ids for r in first] != greedy


def test_stop_token_ids_and_min_new_tokens(pipe):
    first = pipe("Hi", gen_config=_greedy()).token_ids[0]
    stopped = pipe("Hi", gen_config=_greedy(ignore_eos=False, stop_token_ids=[first]))
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    delayed = pipe("Hi", gen_config=_greedy(ignore_eos=False, stop_token_ids=[first], min_new_tokens=4))
    assert delayed.generate_token_len > 4
    assert first not in delayed.token_ids[:4]


def test_bad_token_ids_and_bad_words(pipe, llm):
    banned = pipe("Hi", gen_config=_greedy()).token_ids[0]
    assert banned not in pipe("Hi", gen_config=_greedy(bad_token_ids=[banned])).token_ids
    tokenizer = llm.get_tokenizer()
    word = tokenizer.decode([banned]).strip()
    variants = [tokenizer(v, add_special_tokens=False).input_ids for v in (word, " " + word)]
    assert [banned] in variants  # the word is that one token, so banning the word bans the token
    assert banned not in pipe("Hi", gen_config=_greedy(bad_words=[word])).token_ids


def test_logprobs(pipe):
    response = pipe("Hi", gen_config=_greedy(logprobs=3))
    assert len(response.logprobs) == len(response.token_ids)
    for token, position in zip(response.token_ids, response.logprobs):
        assert token in position and 3 <= len(position) <= 4
        assert all(isinstance(v, float) and v <= 0 for v in position.values())
        assert position[token] == max(position.values())  # greedy picks the most likely token


# --- engine configuration --------------------------------------------------------------------
@pytest.mark.parametrize(
    "config, field",
    [
        (PytorchEngineConfig(num_cpu_blocks=8), "num_cpu_blocks"),
        (PytorchEngineConfig(quant_policy=2), "quant_policy"),
        (PytorchEngineConfig(eviction_type="swap"), "eviction_type"),
        (PytorchEngineConfig(download_dir="/tmp/x"), "download_dir"),
        (PytorchEngineConfig(device_type="ascend"), "device_type"),
        (PytorchEngineConfig(prefill_interval=0), "prefill_interval"),
        (PytorchEngineConfig(cache_max_entry_count=1.5), "cache_max_entry_count"),
        (PytorchEngineConfig(max_prefill_token_num=0), "max_prefill_token_num"),
        (PytorchEngineConfig(max_batch_size=0), "max_batch_size"),
        (TurbomindEngineConfig(model_format="int3"), "model_format"),
        (TurbomindEngineConfig(quant_policy=3), "quant_policy"),
        (TurbomindEngineConfig(rope_scaling_factor=-2.0), "rope_scaling_factor"),
        (TurbomindEngineConfig(use_logn_attn="yes"), "use_logn_attn"),
        (TurbomindEngineConfig(num_tokens_per_iter=8), "num_tokens_per_iter"),
        (TurbomindEngineConfig(max_prefill_iters=2), "max_prefill_iters"),
    ],
)
def test_unsupported_backend_fields_raise(model_dir, config, field):
    with pytest.raises(ValueError, match=rf"EngineConfig\.{field}\b"):
        pipeline(model_dir, backend_config=config)


@pytest.mark.slow  # tp=2 starts worker processes
def test_turbomind_tp_runs_two_ranks(model_dir, pipe):
    """TurbomindEngineConfig(tp=2), as the LMDeploy documents' examples set it: two worker processes,
    the same tokens as one."""
    assert TurbomindEngineConfig(tp=2).to_engine_args("m").tensor_parallel_size == 2
    config = TurbomindEngineConfig(tp=2, session_len=256, cache_max_entry_count=0.05)
    with pipeline(model_dir, backend_config=config) as split:
        assert split.engine.engine_core.executor.world_size == 2
        got = split(PROMPTS, gen_config=_greedy())
    expected = pipe(PROMPTS, gen_config=_greedy())
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]


def test_pytorch_engine_config_mapping():
    args = PytorchEngineConfig(
        dtype="bfloat16",
        session_len=2048,
        max_batch_size=8,
        block_size=32,
        num_gpu_blocks=100,
        max_prefill_token_num=1024,
        enable_prefix_caching=True,
        eager_mode=True,
        device_type="cpu",
        revision="main",
        prefill_interval=1,
        thread_safe=True,
    ).to_engine_args("m")
    assert (args.model, args.dtype, args.max_model_len, args.max_num_seqs) == ("m", "bfloat16", 2048, 8)
    assert (args.block_size, args.num_gpu_blocks_override, args.max_num_batched_tokens) == (32, 100, 1024)
    assert args.enable_prefix_caching and args.enforce_eager and args.device == "cpu" and args.revision == "main"
    defaults = PytorchEngineConfig().to_engine_args("m")
    # The pipeline document's max_batch_size, 128; cache_max_entry_count is LMDeploy's PyTorch engine's 0.8.
    assert defaults.max_model_len is None and defaults.max_num_seqs == 128 and not defaults.enable_prefix_caching
    assert PytorchEngineConfig().cache_max_entry_count == 0.8
    assert defaults.device == "auto" and defaults.block_size == 64 and defaults.max_num_batched_tokens == 4096


def test_cache_max_entry_count_is_a_share_of_free_memory():
    from splitserve.entrypoints.lmdeploy_config import _mem_available_bytes

    free = _mem_available_bytes()
    budget = PytorchEngineConfig(cache_max_entry_count=0.1, device_type="cpu").to_engine_args("m")
    assert 0.05 * free < budget.kv_cache_memory_bytes < 0.15 * free
    assert budget.num_gpu_blocks_override is None
    fixed = PytorchEngineConfig(cache_max_entry_count=0.1, num_gpu_blocks=7, device_type="cpu").to_engine_args("m")
    assert fixed.num_gpu_blocks_override == 7 and fixed.kv_cache_memory_bytes is None


def test_turbomind_engine_config_mapping():
    args = TurbomindEngineConfig(
        session_len=512, max_batch_size=4, cache_block_seq_len=128, enable_prefix_caching=True, model_format="hf"
    ).to_engine_args("m")
    assert (args.max_model_len, args.max_num_seqs, args.block_size) == (512, 4, 128)
    assert args.enable_prefix_caching and args.max_num_batched_tokens == 8192 and args.device == "auto"
    # The pipeline document's defaults
    default = TurbomindEngineConfig()
    assert (default.max_batch_size, default.cache_max_entry_count) == (128, 0.5)
    assert default.to_engine_args("m").max_num_seqs == 128


def test_engine_honours_backend_config(pipe):
    config = pipe.engine.config
    assert config.cache_config.block_size == 64 and config.cache_config.num_gpu_blocks == 64
    assert config.model_config.max_model_len == 256 and not config.cache_config.enable_prefix_caching
    assert str(config.model_config.dtype) == "torch.float32"


# --- pipeline() arguments, chat templates, closing -------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(chat_template_config=42), TypeError),
        (dict(chat_template_config={"model_name": "no-such-template"}), ValueError),
        (dict(chat_template_config={"chat_template": "{{ x }}", "system": "hi"}), ValueError),
        (dict(chat_template_config={"system": "hi"}), ValueError),  # pieces of the tokenizer's template
        (dict(log_level="LOUD"), ValueError),
        (dict(model_name="x"), ValueError),  # not a known chat template name
        (dict(model_name="llama2", backend_config=PytorchEngineConfig(model_name="qwen")), ValueError),
        (dict(tp=2), TypeError),
        (dict(backend_config={"session_len": 8}), TypeError),
    ],
)
def test_pipeline_rejects_bad_arguments(model_dir, kwargs, error):
    with pytest.raises(error):
        pipeline(model_dir, **kwargs)


def test_chat_template_config_and_close(model_dir, llm):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer = llm.get_tokenizer()
    with pipeline(model_dir, backend_config=_backend(), chat_template_config={"chat_template": template}) as p:
        response = p("Shanghai is", gen_config=_greedy())
        ids = tokenizer("Shanghai is", add_special_tokens=False).input_ids
        assert response.input_token_len == len(ids)
        assert response.token_ids == _llm_greedy(llm, {"prompt_token_ids": ids}).token_ids
        stream = p.stream_infer("Hi", gen_config=_greedy())
        next(stream)
    # Leaving the block closed the pipeline, under the open stream too.
    assert p.engine is None
    with pytest.raises(RuntimeError, match="closed"):
        next(stream)
    with pytest.raises(RuntimeError, match="closed"):
        p("Hi")
    p.close()  # closing twice is harmless


def test_response_format_guides_the_output(pipe):
    import json
    import re

    # End to end with a regex: the random model's free whitespace cannot run a JSON guide to max tokens.
    regex = pipe(
        "Hi", gen_config=GenerationConfig(response_format={"type": "regex_schema", "regex_schema": "[0-9]{3}"})
    )
    assert re.fullmatch("[0-9]{3}", regex.text) and regex.finish_reason == "stop"
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    guide = GenerationConfig(response_format=fmt).to_sampling_params().guided_decoding
    assert guide.kind == "json" and json.loads(guide.json) == schema
    json_object = GenerationConfig(response_format={"type": "json_object"}).to_sampling_params().guided_decoding
    assert json_object.kind == "json_object"
    assert GenerationConfig(response_format={"type": "text"}).to_sampling_params().guided_decoding is None


@pytest.mark.parametrize(
    "fmt, error",
    [
        ("json", "must be a dict"),
        ({"type": "json_schema"}, "needs json_schema.schema"),
        ({"type": "regex_schema"}, "needs a regex_schema"),
        ({"type": "yaml"}, "not supported"),
    ],
)
def test_bad_response_format_raises(fmt, error):
    with pytest.raises(ValueError, match=error):
        GenerationConfig(response_format=fmt).to_sampling_params()


def test_adapters_and_adapter_name(model_dir, pipe, tmp_path):
    """PytorchEngineConfig(adapters={name: path}) serves PEFT adapters; adapter_name picks one per call,
    with the offline LLM's tokens for the same adapter."""
    from splitserve import LoRARequest
    from tests.helpers.models import make_peft_adapter

    path = make_peft_adapter(model_dir, str(tmp_path / "sql"), ["q_proj", "v_proj", "down_proj"], r=4, seed=5)
    with pipeline(model_dir, backend_config=_backend(adapters={"sql": path})) as lora_pipe:
        plain = lora_pipe("Shanghai is", gen_config=_greedy())
        adapted = lora_pipe("Shanghai is", gen_config=_greedy(), adapter_name="sql")
        streamed = list(lora_pipe.stream_infer(["Shanghai is"], gen_config=_greedy(), adapter_name="sql"))
        with pytest.raises(ValueError, match="not one of this pipeline's adapters \\(sql\\)"):
            lora_pipe("Hi", adapter_name="nope")
    assert adapted.token_ids != plain.token_ids
    assert [t for r in streamed for t in r.token_ids] == adapted.token_ids
    reference = LLM(
        model_dir, dtype="float32", max_model_len=256, enable_lora=True, max_lora_rank=4, use_tqdm_on_load=False
    )
    text = reference.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Shanghai is"}], tokenize=False, add_generation_prompt=True
    )
    ids = reference.get_tokenizer()(text, add_special_tokens=False).input_ids
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    out = reference.generate(
        {"prompt_token_ids": ids}, params, use_tqdm=False, lora_request=LoRARequest("sql", 1, path)
    )
    assert out[0].outputs[0].token_ids == adapted.token_ids
    with pytest.raises(ValueError, match="none: give PytorchEngineConfig"):
        pipe("Hi", adapter_name="sql")


# --- the pipeline document's other arguments ---------------------------------------------------
def test_named_chat_template_renders_turns_and_stops_at_its_end_word(model_dir, llm):
    """ChatTemplateConfig(model_name='internlm') (the document's internlm-chat-7b): the prompt is
    built from the template's pieces with its default system text, and <eoa> ends the answer."""
    from splitserve import ChatTemplateConfig

    config = ChatTemplateConfig(model_name="internlm", meta_instruction="Be brief.")
    messages = [{"role": "user", "content": "Hi"}]
    expected = "<|System|>:Be brief.\n<|User|>:Hi\n<|Bot|>:"
    assert config.named().render(messages) == expected
    with pipeline(model_dir, backend_config=_backend(), chat_template_config=config) as p:
        response = p("Hi", gen_config=_greedy())
        ids = llm.get_tokenizer()(expected, add_special_tokens=False).input_ids
        assert response.input_token_len == len(ids)
        params = p._prepare("Hi", _greedy(), True, None)[2][0]
        assert "<eoa>" in params.stop
    # model_name on the backend config (or pipeline(model_name=)) names the same template.
    with pipeline(model_dir, backend_config=_backend(model_name="internlm-chat-7b")) as p:
        assert p.chat_template.name == "internlm" and p.chat_template.meta_instruction.startswith("You are an AI")


def test_deprecated_call_arguments_build_the_gen_config(pipe, llm):
    with pytest.warns(DeprecationWarning, match="request_output_len"):
        response = pipe("Shanghai is", request_output_len=5, top_k=1, temperature=0.0, ignore_eos=True)
    assert response.generate_token_len == 5
    assert response.token_ids == pipe("Shanghai is", gen_config=_greedy(max_new_tokens=5, top_k=1)).token_ids
    with pytest.raises(ValueError, match="not both"):
        pipe("Hi", gen_config=_greedy(), top_k=3)
    with pytest.raises(TypeError, match="max_length"):
        pipe("Hi", max_length=3)


def test_model_format_llama_and_hf_read_the_checkpoint_as_it_is():
    for fmt in ("hf", "llama", None):
        assert TurbomindEngineConfig(model_format=fmt).to_engine_args("m").quantization is None


def test_eviction_type_copy_swaps_to_host_blocks():
    """eviction_type='copy': preempted requests' KV goes to num_cpu_blocks host blocks (0: 4 GiB)."""
    args = PytorchEngineConfig(eviction_type="copy", num_cpu_blocks=32).to_engine_args("m")
    assert args.preemption_mode == "swap" and args.num_cpu_blocks == 32
    args = PytorchEngineConfig(eviction_type="copy").to_engine_args("m")
    assert args.preemption_mode == "swap" and args.swap_space == 4.0


def test_pipeline_defaults_are_the_documents(model_dir):
    """pipeline() without a backend_config runs TurbomindEngineConfig's defaults (max_batch_size 128)
    and sets the splitserve logger to the documented log_level, 'ERROR'."""
    import logging

    logger = logging.getLogger("splitserve")
    level = logger.level
    try:
        with pipeline(model_dir) as p:
            assert p.engine.config.scheduler_config.max_num_seqs == 128
            assert logger.level == logging.ERROR
    finally:
        logger.setLevel(level)


@pytest.mark.parametrize(
    "model_path, expected",
    [
        ("internlm/internlm-chat-7b", "internlm"),
        ("internlm/internlm2-chat-7b", "internlm2"),
        ("/models/internlm2_5-7b-chat/", "internlm2"),
        ("Qwen/Qwen-7B-Chat", "qwen"),
        ("meta-llama/Llama-2-7b-chat-hf", "llama2"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", None),
        ("/data/chatml-model", None),  # format names are never guessed from a path
    ],
)
def test_template_matched_by_model_name(model_path, expected):
    from splitserve.entrypoints.lmdeploy_chat_template import best_match_template

    assert best_match_template(model_path) == expected


def test_tokenizer_without_template_takes_lmdeploys_by_name(model_dir, tmp_path):
    """pipeline('internlm/internlm-chat-7b') renders with LMDeploy's internlm template, as LMDeploy
    picks it by the model's name when the tokenizer has none (here a copy of the tiny model without one)."""
    import json
    import shutil

    target = tmp_path / "internlm-chat-7b"
    shutil.copytree(model_dir, target)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    config_file = target / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    tokenizer_config.pop("chat_template", None)
    config_file.write_text(json.dumps(tokenizer_config))
    with pipeline(str(target), backend_config=_backend()) as p:
        assert p.tokenizer.chat_template is None and p.chat_template.name == "internlm"
        out = p("Hi", gen_config=_greedy())
        assert out.input_token_len == len(p.tokenizer(p.chat_template.render_prompt("Hi")).input_ids)
