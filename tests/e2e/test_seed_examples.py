"""Every literal example of the four specification documents (../shared/seeds/), run as written
with only these changes: the package name (`splitserve` for vLLM, FastDeploy, LMDeploy and
AscendCloud's tools), the model (the embedded default model), hosts (loopback) and ports (free
ones). docs/seeds.md maps each document's sections to what serves them.

The documents: 000 Ascend PD deployment (rank tables, three instances, a chat request), 001
FastDeploy api_server (the server command, curl and the OpenAI client), 002 LMDeploy pipeline
(five pipeline examples), 003 AIAK parameters (the quantization tool and the server's tables).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import openai
import pytest

from splitserve import LLM, BeamSearchParams
from splitserve.loader.resolve import DEFAULT_MODEL_NAME, default_model_path
from tests.helpers.pd import wait_for
from tests.helpers.server import RemoteServer, free_port, metric

# Servers, a PD deployment and the default model, as the documents run them; AIAK's quantize command
# quantizes the default model (heavy: minutes).
pytestmark = [pytest.mark.slow, pytest.mark.heavy]

CLI = [sys.executable, "-m", "splitserve.entrypoints.cli"]
SMALL_KV = {"SPLITSERVE_CPU_KVCACHE_SPACE": "1"}  # 1 GiB of KV cache per instance: the machine is small


def _run(args: list[str], cwd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600, **kwargs)


# --- 000: the Ascend PD deployment -------------------------------------------------------------
def _gen(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    # python ${LLM_TOOLS_PATH}/PD_separate/pd_ranktable_tools.py --mode gen --prefill-server-list 4,5
    #   --decode-server-list 6,7 --api-server --save-dir ./save_dir
    args = ["--mode", "gen", "--prefill-server-list", "4,5", "--decode-server-list", "6,7", "--api-server"]
    return _run([*CLI, "ranktable", *args, "--save-dir", "./save_dir", *extra], tmp_path)


def test_ranktable_gen_and_merge_as_documented(tmp_path):
    done = _gen(tmp_path)
    assert done.returncode == 0, done.stderr
    names = sorted(os.listdir(tmp_path / "save_dir"))
    (glob,) = [n for n in names if n.startswith("global_ranktable_")]
    ip = glob.removeprefix("global_ranktable_").removesuffix(".json")
    assert names == sorted(
        [glob, f"local_ranktable_{ip}_45.json", f"local_ranktable_{ip}_67.json", f"local_ranktable_{ip}_host.json"]
    )
    table = json.loads((tmp_path / "save_dir" / glob).read_text())
    groups = table["server_group_list"]
    assert [g["group_id"] for g in groups] == ["0", "1", "2"]
    assert [d["device_id"] for d in groups[1]["server_list"][0]["device"]] == ["4", "5"]
    local = json.loads((tmp_path / "save_dir" / f"local_ranktable_{ip}_67.json").read_text())
    assert local["group_id"] == "0" and local["server_count"] == "1"  # the document's local table shape
    assert [d["device_id"] for d in local["server_list"][0]["device"]] == ["6", "7"]
    # A second machine's table, then the document's merge command.
    (tmp_path / "ranktable").mkdir()
    os.rename(tmp_path / "save_dir" / glob, tmp_path / "ranktable" / "global_ranktable_0.0,0,0.json")
    other = _run(
        [*CLI, "ranktable", "--mode", "gen", "--decode-server-list", "0,1", "--server-ip", "1.1.1.1"], tmp_path
    )
    assert other.returncode == 0, other.stderr
    os.rename(tmp_path / "global_ranktable_1.1.1.1.json", tmp_path / "ranktable" / "global_ranktable_1.1.1.1.json")
    merge = [
        "--mode",
        "merge",
        "--global-ranktable-list",
        "./ranktable/global_ranktable_0.0,0,0.json",
        "./ranktable/global_ranktable_1.1.1.1.json",
        "--save-dir",
        "./save_dir",
    ]
    done = _run([*CLI, "ranktable", *merge], tmp_path)
    assert done.returncode == 0, done.stderr
    merged = json.loads((tmp_path / "save_dir" / "global_ranktable_merge.json").read_text())
    decode_servers = merged["server_group_list"][2]["server_list"]
    assert [s["server_ip"] for s in decode_servers][-1] == "1.1.1.1"


def test_pd_deployment_as_documented(tmp_path, tiny_chat_model):
    """Steps 5 to 9: the tables for 1P1D with tp=2 (devices 4,5 and 6,7, slots on a CPU machine),
    the prefill, decode and scheduler instances started with the document's environment and flags,
    and the document's chat request through the scheduler. The default model's 9 attention heads
    do not split over tp=2, so the instances serve a tiny model whose heads do."""
    assert _gen(tmp_path).returncode == 0
    save = tmp_path / "save_dir"
    glob = next(n for n in os.listdir(save) if n.startswith("global_ranktable_"))
    ip = glob.removeprefix("global_ranktable_").removesuffix(".json")
    model = tiny_chat_model
    ports = [free_port(), free_port(), free_port()]
    flags = [
        f"--model={model}",
        "--tensor-parallel-size=2",
        "--max-model-len=512",  # the document's 4096 is past the tiny model's 512 positions
        "--max-num-seqs=256",
        "--max-num-batched-tokens=4096",
        "--host=127.0.0.1",
    ]
    servers = []
    try:
        for table, port in ((f"local_ranktable_{ip}_45.json", ports[0]), (f"local_ranktable_{ip}_67.json", ports[1])):
            env = {
                **SMALL_KV,
                "GLOBAL_RANK_TABLE_FILE_PATH": str(save / glob),
                "RANK_TABLE_FILE_PATH": str(save / table),
                "NODE_PORTS": f"{ports[0]},{ports[1]}",
                "USE_OPENAI": "1",
            }
            servers.append(
                RemoteServer(None, "serve", *flags, f"--port={port}", "--served-model-name", model, env=env, port=port)
            )
        env = {**env, "RANK_TABLE_FILE_PATH": str(save / f"local_ranktable_{ip}_host.json")}
        scheduler = RemoteServer(
            None, "serve", *flags, f"--port={ports[2]}", "--served-model-name", model, env=env, port=ports[2]
        )
        servers.append(scheduler)
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 100,
            "top_k": -1,
            "top_p": 1,
            "temperature": 0,
            "ignore_eos": False,
            "stream": False,
        }
        r = httpx.post(f"{scheduler.url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] and r.json()["model"] == model
        # The request table's beam search (use_beam_search, best_of, length_penalty) through the
        # scheduler: run whole on a decode instance, it answers as one engine does.
        beam = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "use_beam_search": True}
        beam.update(n=2, best_of=3, length_penalty=0.8, return_token_ids=True)
        r = httpx.post(f"{scheduler.url}/v1/completions", json=beam, timeout=300)
        assert r.status_code == 200, r.text
        llm = LLM(model, max_model_len=512, use_tqdm_on_load=False)
        params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.8)
        expected = llm.beam_search([{"prompt_token_ids": [5, 6, 7, 8]}], params)[0].sequences[:2]
        assert [c["token_ids"] for c in r.json()["choices"]] == [s.tokens[4:] for s in expected]
    finally:
        for server in reversed(servers):
            server.close()


# --- 001: FastDeploy's api_server --------------------------------------------------------------
def test_fastdeploy_tensor_parallel_8_is_refused_for_a_model_it_cannot_split(tmp_path):
    """`--tensor-parallel-size 8` as written: the default model's 9 attention heads do not split 8
    ways, and the server says so at start-up instead of failing later."""
    args = ["-m", "splitserve.entrypoints.openai.api_server", "--model", default_model_path()]
    done = _run([sys.executable, *args, "--port", str(free_port()), "--tensor-parallel-size", "8"], tmp_path)
    assert done.returncode != 0
    assert "8" in done.stderr and "heads" in done.stderr


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp8", "tp8-ep"])
def test_fastdeploy_tensor_parallel_8_serves_an_ernie_moe(tiny_moe_chat_model, expert_parallel):
    """`python -m fastdeploy.entrypoints.openai.api_server --model ernie-45-turbo --port 8188
    --tensor-parallel-size 8` with a tiny ERNIE 4.5 MoE: 8 ranks on CPU slots, each expert's
    channels split 8 ways (or, with --enable-expert-parallel, one whole expert per rank); the
    greedy chat answer is transformers' on the same weights."""
    import torch
    import transformers

    model_dir = tiny_moe_chat_model  # tests/helpers/models.py: ERNIE 4.5 MoE, 8 experts, top-2, 8 heads
    messages = [{"role": "user", "content": "Hello!"}]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = hf.generate(**ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = out[0, ids["input_ids"].shape[1] :].tolist()
    del hf
    args = ["--tensor-parallel-size", "8", *(["--enable-expert-parallel"] if expert_parallel else [])]
    with RemoteServer(model_dir, *args, env=SMALL_KV, startup_timeout=300, entry_point="api_server") as server:
        body = {"messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": True}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        tokens = [entry["token"] for entry in r.json()["choices"][0]["logprobs"]["content"]]
        # /metrics counts the tokens routed to each of the 8 experts (the dashboard's expert load): at
        # least top-2 of every prompt and generated token in each MoE layer.
        routed = 2 * (r.json()["usage"]["prompt_tokens"] + 12)
        wait_for(lambda: metric(server, "splitserve:moe_expert_load_tokens_total") >= routed, 15, "expert load")
        lines = httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines()
        assert len([line for line in lines if line.startswith("splitserve:moe_expert_load_tokens_total{")]) == 8
    assert tokens == [tokenizer.decode([i]) for i in expected]


@pytest.fixture(scope="module")
def fastdeploy_server():
    # python -m fastdeploy.entrypoints.openai.api_server --model ernie-45-turbo --port 8188 (tp 1 here)
    with RemoteServer(default_model_path(), env=SMALL_KV, entry_point="api_server") as server:
        yield server


def test_fastdeploy_curl_chat(fastdeploy_server):
    """The document's curl, which sets no max_tokens: at most 16 tokens, its documented default."""
    r = httpx.post(
        f"{fastdeploy_server.url}/v1/chat/completions",
        headers={"Content-Type": "application/json"},
        json={"messages": [{"role": "user", "content": "Hello!"}], "ignore_eos": True},
        timeout=300,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert r.json()["model"] == DEFAULT_MODEL_NAME
    assert r.json()["usage"]["completion_tokens"] == 16 and r.json()["choices"][0]["finish_reason"] == "length"


def test_fastdeploy_openai_client_chat_and_stream(fastdeploy_server):
    client = openai.Client(base_url=f"{fastdeploy_server.url}/v1", api_key="EMPTY_API_KEY")
    response = client.chat.completions.create(
        model="default",
        messages=[
            {"role": "system", "content": "You are a helpful AI assistant."},
            {"role": "user", "content": "List 3 countries and their capitals."},
        ],
        temperature=1,
        max_tokens=1024,
        stream=False,
    )
    assert response.choices[0].message.content and response.usage.completion_tokens <= 1024
    response = client.chat.completions.create(
        model="default",
        messages=[
            {"role": "system", "content": "You are a helpful AI assistant."},
            {"role": "user", "content": "List 3 countries and their capitals."},
            {"role": "assistant", "content": "China(Beijing), France(Paris), Australia(Canberra)."},
            {"role": "user", "content": "OK, tell more."},
        ],
        temperature=1,
        max_tokens=1024,
        stream=True,
    )
    deltas = [chunk.choices[0].delta for chunk in response if chunk.choices and chunk.choices[0].delta is not None]
    assert "".join(d.content or "" for d in deltas)
    # metadata={"min_tokens": 20}: the client sends metadata values as strings.
    out = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=32,
        metadata={"min_tokens": "20"},
        temperature=0,
    )
    assert out.usage.completion_tokens >= 20


# --- 002: LMDeploy's pipeline ------------------------------------------------------------------
@pytest.fixture
def small_machine(monkeypatch):
    """cache_max_entry_count is a share of free memory: pretend 2 GiB are free, so that the
    examples' default 0.8 does not take most of this machine's memory per pipeline."""
    from splitserve.entrypoints import lmdeploy_config

    monkeypatch.setattr(lmdeploy_config, "_mem_available_bytes", lambda: 2 << 30)


def _texts(response) -> list[str]:
    assert isinstance(response, list) and len(response) == 2
    return [r.text for r in response]


def test_lmdeploy_default_and_pytorch_examples(small_machine):
    from splitserve import GenerationConfig, PytorchEngineConfig, pipeline

    with pipeline(default_model_path()) as pipe:
        response = pipe(["Hi, pls intro yourself", "Shanghai is"])
        assert all(_texts(response))
    backend_config = PytorchEngineConfig(session_len=2024)
    gen_config = GenerationConfig(top_p=0.8, top_k=40, temperature=0.8, max_new_tokens=1024)
    with pipeline(default_model_path(), backend_config=backend_config) as pipe:
        prompts = [
            [{"role": "user", "content": "Hi, pls intro yourself"}],
            [{"role": "user", "content": "Shanghai is"}],
        ]
        response = pipe(prompts, gen_config=gen_config)
        assert all(_texts(response)) and all(r.generate_token_len <= 1024 for r in response)


def test_lmdeploy_turbomind_tp2_examples(small_machine, tiny_chat_model):
    """The three TurbomindEngineConfig(tp=2) examples (plain prompts, a gen_config, OpenAI-style
    messages) share one pipeline: they build the same one. The default model's 9 attention heads
    do not split over 2 ranks, which pipeline() says before loading anything; the examples run on
    a tiny model whose heads do."""
    from splitserve import GenerationConfig, TurbomindEngineConfig, pipeline

    backend_config = TurbomindEngineConfig(tp=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide its 9 attention heads"):
        pipeline(default_model_path(), backend_config=backend_config)
    gen_config = GenerationConfig(top_p=0.8, top_k=40, temperature=0.8, max_new_tokens=1024)
    with pipeline(tiny_chat_model, backend_config=backend_config) as pipe:
        assert all(_texts(pipe(["Hi, pls intro yourself", "Shanghai is"])))
        assert all(_texts(pipe(["Hi, pls intro yourself", "Shanghai is"], gen_config=gen_config)))
        prompts = [
            [{"role": "user", "content": "Hi, pls intro yourself"}],
            [{"role": "user", "content": "Shanghai is"}],
        ]
        assert all(_texts(pipe(prompts, gen_config=gen_config)))


# --- 003: AIAK's parameters --------------------------------------------------------------------
def test_aiak_quantize_command_on_the_default_model(tmp_path):
    # -i M -o OUT -quant_type awq -t bf16 (and -tp 1, which the table marks required); two short
    # calibration sequences instead of the built-in corpus's nine (74 s -> about 25 s: the tool's
    # quality with its defaults is tests/parity/test_quantization_quality.py's)
    out = tmp_path / "awq"
    args = ["quantize", "-i", default_model_path(), "-o", str(out), "-quant_type", "awq", "-tp", "1", "-t", "bf16"]
    args += ["--num-samples", "2", "--seq-len", "128"]
    done = _run([*CLI, *args], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "awq"


def test_aiak_server_flags_and_client_fields(tmp_path):
    """The server flags of AIAK's table, and a completion request with every client field of its
    table; the answer carries its output fields (sentence_length in characters, cum_log_probs)."""
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    flags = [
        *("--model", default_model_path(), "--tokenizer", default_model_path(), "--trust-remote-code"),
        *("--dtype", "bfloat16", "--kv-cache-dtype", "fp8", "--max-model-len", "2048", "-q", "weight_only_int8"),
        *("--distributed-executor-backend", "mp", "--max-seq-len-to-capture", "8192", "--num-scheduler-steps", "1"),
        *("-pp", "1", "-tp", "1", "--enable-prefix-caching", "--gpu-memory-utilization", "0.9"),
        *("--max-num-batched-tokens", "2048", "--max-num-seqs", "256", "--enforce-eager"),
        *("--scheduler-delay-factor", "0", "--enable-chunked-prefill", "--disable-async-output-proc"),
        *("--chat-template", str(template)),
    ]
    port = free_port()
    with RemoteServer(None, "serve", *flags, port=port, env=SMALL_KV) as server:
        body = {
            "model": DEFAULT_MODEL_NAME,
            "prompt": "The capital of France is",
            "best_of": 2,
            "echo": False,
            "frequency_penalty": 0.1,
            "logit_bias": {"0": -100},
            "logprobs": 5,
            "max_tokens": 16,
            "n": 1,
            "presence_penalty": 0.1,
            "seed": 7,
            "stop": "\n\n",
            "stream": False,
            "suffix": None,
            "temperature": 0.7,
            "top_p": 0.9,
            "user": "aiak-user",
        }
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        assert choice["sentence_length"] == len(choice["text"]) and choice["cum_log_probs"] <= 0
        assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
        assert out["system_fingerprint"] and out["object"] == "text_completion"
        stream = httpx.post(
            f"{server.url}/v1/completions",
            json={**body, "best_of": 1, "stream": True, "stream_options": {"include_usage": True}},
            timeout=300,
        )
        assert stream.status_code == 200 and '"usage"' in stream.text
