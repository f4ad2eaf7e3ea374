"""The flags of `splitserve serve` and `python -m splitserve.entrypoints.openai.api_server`: the
engine's (EngineArgs, see engine/arg_utils.py) and the HTTP layer's (ServerArgs)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re

from splitserve import envs
from splitserve.engine import compatibility
from splitserve.engine.arg_flags import add_engine_args, engine_args_from
from splitserve.engine.arg_utils import EngineArgs
from splitserve.entrypoints.openai.api_processes import default_api_server_count
from splitserve.entrypoints.openai.scheduler_args import add_scheduler_args, check_scheduler_args
from splitserve.tracing import check_endpoint


@dataclasses.dataclass
class ServerArgs:
    """Options of the HTTP layer (the engine's are EngineArgs)."""

    host: str = "0.0.0.0"
    port: int = 8000
    metrics_port: int | None = None
    workers: int = 1
    stream_interval: int = 1  # streamed tokens sent this many at a time (the first at once), as vLLM's
    api_key: str | None = None
    metrics_api_key: str | None = None
    chat_template: str | None = None
    max_queued_requests: int | None = None
    reasoning_parser: str | None = None
    use_warmup: bool = False
    disable_log_requests: bool = False
    disable_ui: bool = False  # no chat page at / nor dashboard at /dashboard (splitserve/entrypoints/ui)
    strict_request_fields: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    health_timeout: float = 30.0
    max_engine_restarts: int = 5
    engine_restart_window: float = 600.0
    engine_worker_queue_port: int | None = None
    default_max_tokens: int | None = None
    return_timings: bool = False  # every completion and chat answer carries its timings (openai/timings.py)
    pd: str | None = None
    policy: str = "round_robin"
    uvicorn_log_level: str = "warning"
    metrics_prefix: str = "splitserve"
    otlp_traces_endpoint: str | None = None
    scheduler_name: str = "local"
    scheduler_max_size: int = -1
    scheduler_host: str = "127.0.0.1"  # the global scheduler's Redis (FastDeploy's names and defaults)
    scheduler_port: int = 6379
    scheduler_db: int = 0
    scheduler_password: str = ""
    scheduler_topic: str = "default"
    scheduler_min_load_score: float = 3.0
    batch_files_dir: str | None = None  # None: a temporary directory of this server's (server.py)
    batch_max_file_mb: int = 200
    batch_max_concurrency: int = 8
    allowed_local_media_path: str | None = None  # image files requests may name (file:// URLs), under this directory
    allowed_media_domains: list[str] | None = None  # http(s) image URLs only to these hosts (None: any)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--metrics-port", type=int, default=None, help="serve /metrics here too (default: --port only)")
    g.add_argument(
        "--workers",
        "--api-server-count",
        dest="workers",
        type=int,
        default=None,
        help="API server processes sharing the port (default: 1 on a CPU host; on a GPU host one per 8 CPU cores, "
        "at most 4, logged: entrypoints/openai/api_processes.py)",
    )
    g.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="send streamed tokens this many at a time (the first one at once, the last with the finish): "
        "fewer, larger chunks cost the API process less at high concurrency (default: 1, every token)",
    )
    g.add_argument(
        "--api-key",
        default=envs.SPLITSERVE_API_KEY,
        help="require 'Authorization: Bearer KEY' on every route except /health and /metrics",
    )
    g.add_argument("--metrics-api-key", default=None, help="require this key on /metrics too")
    g.add_argument(
        "--metrics-prefix",
        default="splitserve",
        help="the metrics' name prefix: vllm gives vLLM's own names (vllm:num_requests_running ...), for vLLM's "
        "Grafana dashboards and the routers that read them",
    )
    add_scheduler_args(g)
    g.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="send OpenTelemetry spans of each request (queue, prefill, KV transfer, decode) to this OTLP collector, "
        "e.g. http://localhost:4317 (gRPC; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf for OTLP/HTTP); "
        "needs splitserve[otel]",
    )
    g.add_argument("--chat-template", default=None, help="a jinja chat template: a file path or the template itself")
    g.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="let image_url parts name files (file:// URLs) under this directory (default: no local files)",
    )
    g.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        help="fetch http(s) image URLs only from these host names (default: any; the fetch times out after "
        "$SPLITSERVE_IMAGE_FETCH_TIMEOUT s)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="answer 429 when this many requests are already waiting in the engine",
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        help="split <think> reasoning out into reasoning_content: deepseek_r1, qwen3 or ernie45 (default: the "
        "family's parser for a model whose chat template thinks; none: off)",
    )
    g.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="max_tokens of a request that leaves it unset (chat) or null: default, the model's max_new_tokens, "
        "else the rest of the context; python -m splitserve.entrypoints.openai.api_server defaults to 16, as "
        "FastDeploy's document says",
    )
    g.add_argument("--use-warmup", action="store_true", help="run one short request before accepting traffic")
    g.add_argument("--disable-log-requests", action="store_true", help="do not log each request")
    g.add_argument(
        "--disable-ui", action="store_true", help="serve no chat page at / nor dashboard at /dashboard (docs/ui.md)"
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto", the default with tools); needs '
        "--tool-call-parser",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        help="how tool calls are read from the model's text: hermes, llama3_json, mistral or pythonic",
    )
    g.add_argument(
        "--strict-request-fields",
        action="store_true",
        help="answer 400 to request fields splitserve does not know (default: ignore them, with a warning, as vLLM)",
    )
    g.add_argument(
        "--return-timings",
        action="store_true",
        help="put llama.cpp's timings (queue, prompt and decode times, tokens per second) in every completion and "
        "chat answer, as llama-server does; without it a request asks with return_timings: true",
    )
    g.add_argument(
        "--health-timeout",
        type=float,
        default=30.0,
        help="/health answers 503 when the engine does not answer within this many seconds",
    )
    g.add_argument(
        "--max-engine-restarts",
        type=int,
        default=5,
        help="restart the engine when it dies, at most this many times within --engine-restart-window; past "
        "that (and at once with 0) the server exits non-zero, for an outer supervisor to restart",
    )
    g.add_argument(
        "--engine-restart-window",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="the window over which --max-engine-restarts counts restarts",
    )
    g.add_argument(
        "--engine-worker-queue-port",
        type=int,
        default=None,
        help="loopback TCP port between API workers and the engine (default: an IPC socket file)",
    )
    g.add_argument(
        "--pd",
        default=None,
        metavar="XpYd",
        help="one-command PD deployment: X prefill and Y decode instances behind a router on --port",
    )
    g.add_argument(
        "--policy",
        default="round_robin",
        choices=["round_robin", "least_load", "prefix_aware", "cache_aware"],
        help="how the PD router picks instances",
    )
    g.add_argument("--uvicorn-log-level", default="warning")
    g.add_argument(
        "--batch-files-dir",
        default=None,
        help="where /v1/files keeps its files and /v1/batches its batches, shared by the API workers (default: a "
        "temporary directory of the server's, removed when it stops)",
    )
    g.add_argument(
        "--batch-max-file-mb", type=int, default=200, help="the largest file POST /v1/files takes, in MiB (OpenAI's)"
    )
    g.add_argument(
        "--batch-max-concurrency",
        type=int,
        default=8,
        help="requests of one batch (/v1/batches) in flight at once",
    )


def make_arg_parser(
    parser: argparse.ArgumentParser | None = None, default_max_tokens: int | None = None
) -> argparse.ArgumentParser:
    """The flags; `default_max_tokens` is the entry point's own default of --default-max-tokens."""
    parser = parser or argparse.ArgumentParser(prog="splitserve serve", description="OpenAI-compatible server")
    parser.add_argument("model_tag", nargs="?", default=None, help="the model (same as --model)")
    add_engine_args(parser)
    add_server_args(parser)
    parser.set_defaults(default_max_tokens=default_max_tokens)
    return parser


def split_args(ns: argparse.Namespace) -> tuple[EngineArgs, ServerArgs]:
    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise ValueError(f"Two models given: {ns.model_tag!r} and --model {ns.model!r}.")
        ns.model = ns.model_tag
    server = ServerArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerArgs)})
    engine = engine_args_from(ns)
    if server.workers is None:
        server.workers = default_api_server_count(engine.device)
    if server.scheduler_name == "global" and engine.pd_role != "mixed":
        raise compatibility.refusal("global_scheduler+pd")
    if engine.data_parallel_size > 1 and engine.pd_role != "mixed":
        raise compatibility.refusal("data_parallel+pd")
    if engine.data_parallel_size > 1 and server.scheduler_name == "global":
        raise compatibility.refusal("data_parallel+global_scheduler")
    check_server_args(server)  # after the combinations: it may reach out (the global scheduler's Redis)
    return engine, server


def check_server_args(args: ServerArgs) -> None:
    """Refuse bad server flags with a message; a chat template given as a file is read here."""
    from splitserve.entrypoints.openai.reasoning import REASONING_PARSERS
    from splitserve.entrypoints.openai.tool_parsers import TOOL_PARSERS

    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}.")
    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval must be >= 1, got {args.stream_interval}.")
    if args.reasoning_parser not in (None, "none", *REASONING_PARSERS):
        raise ValueError(
            f"--reasoning-parser must be none or one of {sorted(REASONING_PARSERS)}, got {args.reasoning_parser!r}."
        )
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, got {args.tool_call_parser!r}.")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser to read the calls.")
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        raise ValueError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}.")
    if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", args.metrics_prefix):
        raise ValueError(
            f"--metrics-prefix must be a Prometheus name (letters, digits, _), got {args.metrics_prefix!r}."
        )
    if args.max_engine_restarts < 0:
        raise ValueError(f"--max-engine-restarts must be >= 0, got {args.max_engine_restarts}.")
    if args.engine_restart_window <= 0:
        raise ValueError(f"--engine-restart-window must be > 0, got {args.engine_restart_window}.")
    if args.batch_max_file_mb < 1 or args.batch_max_concurrency < 1:
        raise ValueError("--batch-max-file-mb and --batch-max-concurrency must be >= 1.")
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise ValueError("--max-queued-requests must be >= 0.")
    check_scheduler_args(args)
    check_endpoint(args.otlp_traces_endpoint)
    if args.chat_template is not None:
        args.chat_template = load_chat_template(args.chat_template)


def load_chat_template(value: str) -> str:
    """A file path or an inline jinja template (anything with template syntax is inline)."""
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a readable file nor a jinja template.")
