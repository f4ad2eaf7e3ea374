"""The combinations of features splitserve refuses, and why: one table, in one place.

Each rule names its two features as a user writes them and the sentence that explains the refusal.
A rule with `applies` is checked before anything starts (`check`, called by
EngineArgs.create_engine_config): the server, the offline LLM and each `serve --pd` instance stop
with one line naming both features. A rule without it is raised by the code that knows (the
server's flags, a request that finds the engine in that state, or a choice made from the model's
config), through `refusal`, so that the words are this table's. docs/compatibility.md is
`markdown_table()`; a test keeps the two equal, and gives every start-up rule an example that it
refuses and the same example without its second feature, which starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.config import LOAD_FORMATS


@dataclass(frozen=True)
class Rule:
    name: str
    first: str  # the features as a user writes them
    second: str
    reason: str
    where: str = "start-up"  # where it is refused: "start-up", or the request or call that is refused
    applies: Callable | None = None  # (EngineArgs) -> bool, for the start-up rules
    example: dict = field(default_factory=dict)  # EngineArgs fields that trip it (start-up rules; tests)
    without_second: dict = field(default_factory=dict)  # the example's fields with the second feature taken off

    def message(self) -> str:
        return f"{self.first} with {self.second}: {self.reason}"


def _speculative(args) -> bool:
    return bool(args.speculative_config)


def _draft_model(args) -> bool:
    config = args.speculative_config
    if isinstance(config, str):
        import json

        try:
            config = json.loads(config)
        except ValueError:
            return False  # SpeculativeConfig.parse says what is wrong with it
    return isinstance(config, dict) and bool(config.get("model")) and config.get("method") in (None, "draft_model")


def _pooling(args) -> bool:
    return args.runner == "pooling" or args.task in ("embed", "embedding", "classify", "score", "rerank")


_NGRAM = {"method": "ngram", "num_speculative_tokens": 2}

RULES = [
    Rule(
        "async_scheduling+pipeline_parallel",
        "--async-scheduling",
        "pipeline parallelism (-pp > 1)",
        "the first stage would need the last stage's sampled tokens on its own device before the step ends.",
        applies=lambda a: a.async_scheduling is True and a.pipeline_parallel_size > 1,
        example={"async_scheduling": True, "pipeline_parallel_size": 2},
        without_second={"async_scheduling": True},
    ),
    Rule(
        "async_scheduling+disable_async_output_proc",
        "--async-scheduling",
        "--disable-async-output-proc",
        "the second turns off the overlap that the first asks for.",
        applies=lambda a: a.async_scheduling is True and a.disable_async_output_proc,
        example={"async_scheduling": True, "disable_async_output_proc": True},
        without_second={"async_scheduling": True},
    ),
    Rule(
        "draft_model+pipeline_parallel",
        "speculative decoding with a draft model",
        "pipeline parallelism (-pp > 1)",
        "the draft model runs whole beside the target on each rank, and a pipeline stage holds only some of "
        "the target's layers; n-gram speculation works with pipeline parallelism.",
        applies=lambda a: _draft_model(a) and a.pipeline_parallel_size > 1,
        example={"speculative_config": {"model": "/draft", "num_speculative_tokens": 2}, "pipeline_parallel_size": 2},
        without_second={"speculative_config": {"model": "/draft", "num_speculative_tokens": 2}},
    ),
    Rule(
        "kv_offloading+no_prefix_caching",
        "KV offloading (--kv-offloading-size, --kv-cache-dir)",
        "--no-enable-prefix-caching",
        "the offloading tier keeps prefix-cache blocks, and there are none without prefix caching.",
        applies=lambda a: bool(a.kv_offloading_size or a.kv_cache_dir) and not a.enable_prefix_caching,
        example={"kv_offloading_size": 0.1, "enable_prefix_caching": False},
        without_second={"kv_offloading_size": 0.1},
    ),
    Rule(
        "pooling+speculative",
        "the pooling runner (embeddings, --runner pooling)",
        "speculative decoding",
        "a pooling request computes its prompt once and generates nothing to speculate on.",
        applies=lambda a: _pooling(a) and _speculative(a),
        example={"runner": "pooling", "speculative_config": _NGRAM},
        without_second={"runner": "pooling"},
    ),
    Rule(
        "pooling+pd_role",
        "the pooling runner (embeddings, --runner pooling)",
        "a PD role (--pd-role prefill or decode)",
        "a pooling request ends with its prompt: there is no decode to hand it to.",
        applies=lambda a: _pooling(a) and a.pd_role != "mixed",
        example={"runner": "pooling", "pd_role": "prefill"},
        without_second={"runner": "pooling"},
    ),
    Rule(
        "global_scheduler+pd",
        "--scheduler-name global",
        "PD (--pd-role, serve --pd)",
        "the shared queue hands whole requests to mixed instances, while the PD router splits each request "
        "between a prefill and a decode instance.",
    ),
    Rule(
        "data_parallel+pd",
        "--data-parallel-size > 1",
        "PD (--pd-role, serve --pd)",
        "the replicas behind one server answer whole requests; give PD more instances instead (--pd XpYd).",
    ),
    Rule(
        "data_parallel+global_scheduler",
        "--data-parallel-size > 1",
        "--scheduler-name global",
        "run one server per replica, each taking work from the shared queue.",
    ),
    Rule(
        "serve_pd+metrics_port",
        "serve --pd",
        "--metrics-port",
        "the router serves /metrics on --port, and every instance on its own port.",
    ),
    Rule(
        "serve_pd+pd_role",
        "serve --pd",
        "--pd-role",
        "serve --pd gives each instance its role.",
    ),
]
_BY_NAME = {rule.name: rule for rule in RULES}


class CombinationRefused(ValueError):
    """Two features that do not go together (a ValueError: start-up reports it in one line)."""

    def __init__(self, rule: Rule):
        super().__init__(rule.message())
        self.rule = rule


def refusal(name: str) -> CombinationRefused:
    """The error of the rule `name`, for the code that finds the combination itself."""
    return CombinationRefused(_BY_NAME[name])


def check(args) -> None:
    """Refuse EngineArgs that combine features of a start-up rule (the first such rule)."""
    for rule in RULES:
        if rule.applies is not None and rule.applies(args):
            raise CombinationRefused(rule)


def markdown_table() -> str:
    lines = ["| feature | with | refused at | why |", "|---|---|---|---|"]
    for rule in RULES:
        lines.append(f"| {rule.first} | {rule.second} | {rule.where} | {rule.reason} |")
    return "\n".join(lines) + "\n"


def check_settings(args) -> None:
    """Refuse EngineArgs settings whose feature does not exist yet, instead of silently ignoring them,
    and combinations of features that do not go together (check)."""
    check(args)
    if args.swap_space < 0 or (args.num_cpu_blocks is not None and args.num_cpu_blocks < 0):
        raise ValueError("swap_space and num_cpu_blocks must be >= 0.")
    swap_memory = args.swap_space > 0 or bool(args.num_cpu_blocks)
    if swap_memory and args.preemption_mode != "swap":
        raise ValueError("--swap-space / num_cpu_blocks is host memory for --preemption-mode swap; set that too.")
    if args.preemption_mode == "swap" and not swap_memory:
        raise ValueError("--preemption-mode swap needs host memory: give --swap-space (GiB per rank).")
    if args.kv_offloading_backend not in (None, "native"):
        raise ValueError(
            f"--kv-offloading-backend {args.kv_offloading_backend!r}: only 'native' is built (host memory, and "
            "disk with --kv-cache-dir); LMCache is not integrated."
        )
    if args.kv_offloading_backend and not (args.kv_offloading_size or args.kv_cache_dir):
        raise ValueError("--kv-offloading-backend needs --kv-offloading-size (GiB of host memory).")
    if args.num_scheduler_steps != 1:
        raise ValueError(
            f"num_scheduler_steps={args.num_scheduler_steps}: multi-step decoding is not implemented; only 1 "
            "is. Its purpose, hiding the scheduler's time behind the device's, is what --async-scheduling "
            "does (on by default on GPUs)."
        )
    if args.tokenizer_extension_path is not None:
        raise ValueError(
            "--tokenizer-extension-path (AIAK's vllm_extension.py hook) is not supported: splitserve loads "
            "tokenizers with transformers. Give a tokenizer directory with --tokenizer (and "
            "--trust-remote-code for a custom tokenizer class)."
        )
    if args.max_seq_len_to_capture < 1:
        raise ValueError(f"max_seq_len_to_capture must be >= 1, got {args.max_seq_len_to_capture}.")
    if args.cuda_graph_sizes is not None and (not args.cuda_graph_sizes or min(args.cuda_graph_sizes) < 1):
        raise ValueError(f"cuda_graph_sizes must be positive batch sizes, got {args.cuda_graph_sizes}.")
    if args.load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {args.load_format!r}.")
