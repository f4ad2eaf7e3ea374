"""Memory rooflines of the GPU check's benchmarks (splitserve/benchmarks/gpu_check.py): the time the
decode steps of a workload need to read every weight once per step and each running request's K and
V, divided by the card's memory bandwidth. A bound no engine beats: prompt compute and everything
else are left out."""

from __future__ import annotations

import argparse
import time

# Memory bandwidth (bytes/s) by GPU name, from the vendors' data sheets; other cards are measured.
BANDWIDTH_BY_NAME = (("H200", 4.8e12), ("H100 SXM", 3.35e12), ("H100 80GB HBM3", 3.35e12))


def model_bytes(model: str, dtype_bytes: int) -> tuple[int, int]:
    """(bytes of weights a decode step reads, bytes of K and V per cached token) of `model` (a built-in
    hub id or a directory with a config.json). A step reads every weight once, except an untied input
    embedding, of which it reads a row per token."""
    import torch
    import transformers

    from splitserve.loader.known_configs import builtin_config_path

    config = transformers.AutoConfig.from_pretrained(builtin_config_path(model) or model)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    unique = {id(p): p.numel() for p in hf.parameters()}
    params = sum(unique.values())
    if not getattr(config, "tie_word_embeddings", False):
        params -= hf.get_input_embeddings().weight.numel()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return params * dtype_bytes, 2 * config.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def bandwidth(dry_run: bool) -> dict:
    """The memory bandwidth to divide by: the data sheet's for the cards named in BANDWIDTH_BY_NAME,
    else a device-to-device copy (bytes read + written per second), on the CPU when there is no GPU."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    for key, value in BANDWIDTH_BY_NAME:
        if key in name:
            return {"device": name, "bytes_per_s": value, "source": f"data sheet ({key})"}
    size = (16 if dry_run or device == "cpu" else 1024) << 20
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start, reps = time.perf_counter(), 5
    for _ in range(reps):
        dst.copy_(src)
    sync()
    measured = 2 * size * reps / (time.perf_counter() - start)
    return {"device": name, "bytes_per_s": measured, "source": f"measured copy of {size >> 20} MiB on {device}"}


def decode_seconds(requests: list[tuple[int, int]], concurrency: int, weights: int, kv_token: int, bw: float) -> float:
    """Seconds the decode steps of `requests` ((prompt length, output length), admitted in order, at most
    `concurrency` at once) need to read the weights once per step and each request's KV cache."""
    waiting, active, total = list(requests), [], 0
    while waiting or active:
        while waiting and len(active) < concurrency:
            prompt, out = waiting.pop(0)
            active.append([prompt, out])
        total += weights + kv_token * sum(ctx for ctx, _ in active)
        for req in active:
            req[0] += 1
            req[1] -= 1
        active = [req for req in active if req[1] > 0]
    return total / bw


def _workload_lengths(argv: list[str]) -> list[tuple[int, int]]:
    """The (prompt, output) lengths `bench throughput` draws for these arguments."""
    from splitserve.benchmarks import throughput

    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    ns, _ = parser.parse_known_args(argv)
    work = throughput.make_workload(ns, 64, set())
    return [(len(p), n) for p, n in zip(work.prompts, work.output_lens)]


def _option(argv: list[str], name: str, default: float) -> float:
    return float(argv[argv.index(name) + 1]) if name in argv else default


def roofline(argv: list[str], served: bool, weights: int, kv_token: int, bw: float) -> dict:
    """The bound of each figure of the benchmark run with `argv` (`bench serve`'s when `served`, else
    `bench throughput`'s), in its units."""
    if served:
        conc = int(_option(argv, "--max-concurrency", 1))
        ctx = _option(argv, "--random-input-len", 1024) + _option(argv, "--random-output-len", 128) / 2
        step = (weights + kv_token * conc * ctx) / bw
        return {"output_tok_s": conc / step, "tpot_ms": 1e3 * step}
    lengths = _workload_lengths(argv)
    seconds = decode_seconds(lengths, int(_option(argv, "--max-num-seqs", 256)), weights, kv_token, bw)
    tokens = sum(n for _, n in lengths)
    return {"output_tok_s": tokens / seconds, "ms_per_token": 1e3 * seconds / tokens}
