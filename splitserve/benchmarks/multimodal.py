"""`splitserve bench mm`: image requests through splitserve and through transformers on the same
vision-language model, one after the other in one run: time to first token of one request (an
image of --image-size pixels square and --text-len text tokens), and the output throughput of
--num-prompts such requests (each its own image) at --concurrency (transformers: batched generate of
that many at a time).

With --load-format dummy and a built-in config (Qwen/Qwen2-VL-2B-Instruct), the model is that shape
with random weights: the config, the embedded default model's tokenizer with the model's vision
tokens added, and the model's image processor are written to a directory under splitserve's cache,
which both engines load. Outputs are forced to --output-len tokens on both sides.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import time

import numpy as np

from splitserve import envs
from splitserve.engine.arg_utils import EngineArgs

_VISION_TOKENS = {
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "vision_token_id": "<|vision_pad|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
}
_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
_WORDS = "the quick brown fox jumps over a lazy dog near river bank while birds sing songs".split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--image-size", type=int, default=448, help="square images of this many pixels a side")
    parser.add_argument("--text-len", type=int, default=32, help="text tokens of each prompt besides its image")
    parser.add_argument(
        "--output-len", type=int, default=128, help="tokens each request generates (vLLM's random dataset: 128)"
    )
    parser.add_argument("--num-prompts", type=int, default=32, help="requests of the throughput run")
    parser.add_argument("--concurrency", type=int, default=16, help="requests at once (transformers: batch size)")
    parser.add_argument("--ttft-runs", type=int, default=3, help="single requests timed for time to first token")
    parser.add_argument("--backend", nargs="+", default=["splitserve", "hf"], choices=["splitserve", "hf"])
    parser.set_defaults(model="Qwen/Qwen2-VL-2B-Instruct", load_format="dummy", dtype="bfloat16")


def main(ns: argparse.Namespace, args: EngineArgs) -> None:
    if args.load_format == "dummy" and not os.path.isdir(args.model):
        args = dataclasses.replace(args, model=synthetic_model_dir(args.model))
    requests = _requests(args.model, ns)
    results = {}
    for backend in ns.backend:
        run = _run_splitserve if backend == "splitserve" else _run_hf
        results[backend] = run(args, ns, requests)
        gc.collect()
        print(f"{backend}: TTFT {results[backend][0] * 1e3:.0f} ms, {results[backend][1]:.1f} output tok/s", flush=True)
    _report(ns, results)


def synthetic_model_dir(model_id: str) -> str:
    """A directory holding `model_id`'s built-in config, a tokenizer with its vision tokens and its
    image processor, for random weights (written once under the cache)."""
    from transformers import AutoConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from splitserve.loader import known_configs
    from splitserve.loader.resolve import default_model_path
    from splitserve.tokenizer import get_tokenizer

    path = known_configs.builtin_config_path(model_id)
    if path is None or "Qwen2VL" not in open(path).read():
        raise ValueError(
            f"bench mm builds random-weight Qwen2-VL models from built-in configs; {model_id!r} is not one."
        )
    directory = os.path.join(envs.cache_root(), "bench-mm", model_id.replace("/", "--"))
    if os.path.isfile(os.path.join(directory, "preprocessor_config.json")):
        return directory
    tokenizer = get_tokenizer(default_model_path())
    tokenizer.add_special_tokens({"additional_special_tokens": sorted(set(_VISION_TOKENS.values()))})
    with open(path) as f:
        config = json.load(f)
    config.update({key: tokenizer.convert_tokens_to_ids(token) for key, token in _VISION_TOKENS.items()})
    config.update(bos_token_id=tokenizer.bos_token_id or 0, eos_token_id=tokenizer.eos_token_id)
    os.makedirs(directory, exist_ok=True)
    tokenizer.save_pretrained(directory)
    Qwen2VLImageProcessorPil().save_pretrained(directory)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    AutoConfig.from_pretrained(directory)  # it must load
    return directory


def _requests(directory: str, ns: argparse.Namespace) -> list[tuple[str, object]]:
    """num_prompts + ttft_runs + 1 (text, image) pairs, every image its own random pixels."""
    from PIL import Image

    from splitserve.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(directory)
    words, out = [], []
    while len(tokenizer(" ".join(words), add_special_tokens=False).input_ids) < ns.text_len:
        words.append(_WORDS[len(words) % len(_WORDS)])
    text = " ".join(words)
    rng = np.random.default_rng(0)
    for _ in range(ns.num_prompts + ns.ttft_runs + 1):
        pixels = rng.integers(0, 256, (ns.image_size, ns.image_size, 3), dtype=np.uint8)
        out.append((f"{_PLACEHOLDER}{text}", Image.fromarray(pixels, "RGB")))
    return out


def _run_splitserve(args: EngineArgs, ns: argparse.Namespace, requests) -> tuple[float, float]:
    from splitserve.entrypoints.llm import LLM
    from splitserve.sampling_params import SamplingParams

    llm = LLM(**dataclasses.asdict(dataclasses.replace(args, max_num_seqs=ns.concurrency)))
    params = SamplingParams(max_tokens=ns.output_len, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def prompt(text, image):
        return {"prompt": text, "multi_modal_data": {"image": image}}

    llm.generate(prompt(*requests[0]), first, use_tqdm=False)  # warm-up
    ttfts = []
    for text, image in requests[1 : 1 + ns.ttft_runs]:
        start = time.perf_counter()
        llm.generate(prompt(text, image), first, use_tqdm=False)
        ttfts.append(time.perf_counter() - start)
    batch = [prompt(*r) for r in requests[1 + ns.ttft_runs :]]
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    del llm
    return statistics.median(ttfts), tokens / elapsed


def _run_hf(args: EngineArgs, ns: argparse.Namespace, requests) -> tuple[float, float]:
    import torch
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from splitserve.devices import resolve_dtype

    directory = args.model
    dtype = resolve_dtype(args.dtype, torch.bfloat16, torch.device("cpu"))
    config = AutoConfig.from_pretrained(directory)
    model = AutoModelForImageTextToText.from_config(config, dtype=dtype).eval()
    processor, tokenizer = AutoImageProcessor.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)

    def generate(pairs, new_tokens: int):
        inputs = dict(processor(images=[image for _, image in pairs], return_tensors="pt"))
        tokens = int(inputs["image_grid_thw"][0].prod()) // config.vision_config.spatial_merge_size**2
        texts = [text.replace("<|image_pad|>", "<|image_pad|>" * tokens) for text, _ in pairs]
        encoded = tokenizer(texts, return_tensors="pt")  # one length: every image is one size
        ids, inputs["attention_mask"] = encoded.input_ids, encoded.attention_mask
        inputs["mm_token_type_ids"] = (ids == config.image_token_id).int()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
            )
        return (out.shape[1] - ids.shape[1]) * len(pairs)

    generate(requests[:1], 1)  # warm-up
    ttfts = []
    for pair in requests[1 : 1 + ns.ttft_runs]:
        start = time.perf_counter()
        generate([pair], 1)
        ttfts.append(time.perf_counter() - start)
    batch, tokens = requests[1 + ns.ttft_runs :], 0
    start = time.perf_counter()
    for i in range(0, len(batch), ns.concurrency):
        tokens += generate(batch[i : i + ns.concurrency], ns.output_len)
    elapsed = time.perf_counter() - start
    return statistics.median(ttfts), tokens / elapsed


def _report(ns: argparse.Namespace, results: dict) -> None:
    print(
        f"\n{ns.num_prompts} requests of one {ns.image_size} x {ns.image_size} image + {ns.text_len} text tokens, "
        f"{ns.output_len} output tokens, concurrency {ns.concurrency}"
    )
    print(f"{'backend':<12}{'TTFT ms':>10}{'output tok/s':>15}")
    for backend, (ttft, throughput) in results.items():
        print(f"{backend:<12}{ttft * 1e3:>10.0f}{throughput:>15.1f}")
    if {"splitserve", "hf"} <= set(results):
        (s_ttft, s_tput), (h_ttft, h_tput) = results["splitserve"], results["hf"]
        print(f"splitserve / transformers: TTFT {s_ttft / h_ttft:.2f}x, throughput {s_tput / h_tput:.2f}x")
