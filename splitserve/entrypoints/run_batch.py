"""`splitserve run-batch -i requests.jsonl -o results.jsonl --model M`: OpenAI's batch file format run
offline, as vLLM's `run-batch` does.

Each input line is one request, `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions"
(or "/v1/completions"), "body": {...}}`; each output line is its result, `{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}`, the body being exactly what the server
would answer. The requests go through the server's own handlers (validation, chat templates, tools,
structured output), on an engine process of their own, without HTTP. Lines are read as they are
needed and results written as they finish (in that order, not the input's: match them by
`custom_id`), with at most `--max-concurrency` requests in flight, so memory stays flat however long
the file is; a progress bar counts the lines done.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from contextlib import ExitStack
from functools import partial

from splitserve.engine.arg_flags import add_engine_args, engine_args_from
from splitserve.entrypoints.openai.args import ServerArgs
from splitserve.entrypoints.openai.batch_runner import count_lines, numbered_lines, run_line, run_lines

logger = logging.getLogger("splitserve.run_batch")

# The server flags that change how a request is read or answered (the rest are about HTTP).
_SERVER_FLAGS = {
    "--chat-template": "a jinja chat template: a file path or the template itself",
    "--reasoning-parser": "split <think> reasoning into reasoning_content: deepseek_r1, qwen3, ernie45 or none",
    "--tool-call-parser": "how tool calls are read: hermes, llama3_json, mistral or pythonic",
    "--default-max-tokens": "max_tokens of a request that leaves it unset",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input-file", required=True, help="the requests, one JSON object per line")
    parser.add_argument("-o", "--output-file", required=True, help="where the results go, one JSON object per line")
    parser.add_argument("--max-concurrency", type=int, default=256, help="requests in flight at once")
    for flag, help_text in _SERVER_FLAGS.items():
        parser.add_argument(flag, default=None, type=int if flag == "--default-max-tokens" else str, help=help_text)
    parser.add_argument("--enable-auto-tool-choice", action="store_true", help="as `splitserve serve`'s flag")
    add_engine_args(parser)


def main(ns: argparse.Namespace) -> None:
    if ns.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {ns.max_concurrency}.")
    server_args = ServerArgs(
        chat_template=ns.chat_template,
        reasoning_parser=ns.reasoning_parser,
        tool_call_parser=ns.tool_call_parser,
        default_max_tokens=ns.default_max_tokens,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        disable_log_requests=True,
    )
    from splitserve.entrypoints.openai.args import check_server_args

    check_server_args(server_args)
    engine_args = engine_args_from(ns)
    from splitserve.entrypoints.openai.server import refuse_data_parallel

    refuse_data_parallel(engine_args)
    summary = asyncio.run(_run(ns, engine_args, server_args))
    print(
        f"run-batch: {summary['lines']} lines, {summary['ok']} answered 200, {summary['errors']} errors, "
        f"in {summary['seconds']:.1f} s -> {ns.output_file}"
    )


async def _run(ns: argparse.Namespace, engine_args, server_args: ServerArgs) -> dict:
    from tqdm import tqdm

    from splitserve.engine.async_llm import AsyncLLM
    from splitserve.engine.engine_process import DeferredEngineConfig, EngineProcess
    from splitserve.entrypoints.openai.metrics import Metrics
    from splitserve.entrypoints.openai.serving_chat import OpenAIServingChat
    from splitserve.entrypoints.openai.serving_completion import OpenAIServingCompletion

    started = time.monotonic()
    config = engine_args.create_engine_config()
    config.health_timeout = server_args.health_timeout
    engine_process = EngineProcess(DeferredEngineConfig(engine_args, server_args.health_timeout))
    with ExitStack() as stack:
        stack.callback(engine_process.shutdown)
        await asyncio.to_thread(engine_process.wait_ready, config)
        engine = AsyncLLM(config.model_config, engine_process.address, engine_process.pid)
        engine.scheduling_policy = config.scheduler_config.policy
        stack.callback(engine.shutdown)
        metrics = Metrics(config.model_config.served_model_name)
        handlers = {
            "/v1/completions": OpenAIServingCompletion(engine, config, server_args, metrics).create_completion,
            "/v1/chat/completions": OpenAIServingChat(engine, config, server_args, metrics).create_chat_completion,
        }
        counts = {"ok": 0, "errors": 0}
        out = stack.enter_context(open(ns.output_file, "w"))
        bar = stack.enter_context(tqdm(total=count_lines(ns.input_file), desc="Batch requests", unit="req"))

        def done(result: dict) -> None:
            out.write(json.dumps(result) + "\n")
            counts["ok" if result["response"]["status_code"] == 200 else "errors"] += 1
            bar.update(1)

        with open(ns.input_file) as f:
            await run_lines(numbered_lines(f), partial(run_line, handlers=handlers), done, ns.max_concurrency)
    return counts | {"lines": counts["ok"] + counts["errors"], "seconds": time.monotonic() - started}


if __name__ == "__main__":  # python -m splitserve.entrypoints.run_batch
    parser = argparse.ArgumentParser(prog="splitserve run-batch", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    main(parser.parse_args(sys.argv[1:]))
