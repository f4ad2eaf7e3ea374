"""The `splitserve` command: one subcommand per tool (serve, router, generate, bench, quantize, ...)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from splitserve import envs
from splitserve.engine.arg_flags import add_engine_args, engine_args_from
from splitserve.process_utils import main_and_exit


def _cmd_generate(ns: argparse.Namespace) -> None:
    from splitserve.entrypoints.llm import LLM
    from splitserve.sampling_params import SamplingParams

    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, max_tokens=ns.max_tokens, seed=ns.seed)
    prompts = ns.prompt or ["Hello, my name is", "The capital of France is", "List 3 countries and their capitals."]
    if ns.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        print(f"\n=== {prompt!r}\n{out.outputs[0].text}")


def _cmd_serve(ns: argparse.Namespace) -> None:
    from splitserve.entrypoints.openai.args import split_args
    from splitserve.entrypoints.serve import serve

    serve(*split_args(ns))


def _add_generate(gen: argparse.ArgumentParser) -> None:
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: three examples")
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap each prompt in the model's chat template as a user message",
    )
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.set_defaults(func=_cmd_generate)


def _add_serve(serve: argparse.ArgumentParser) -> None:
    from splitserve.entrypoints.openai.args import make_arg_parser

    make_arg_parser(serve)
    serve.set_defaults(func=_cmd_serve)


def _add_router(rt: argparse.ArgumentParser) -> None:
    from splitserve.entrypoints import router

    router.add_arguments(rt)
    rt.set_defaults(func=lambda ns: router.main(ns))  # the app is imported when the router runs


def _add_perplexity(ppl: argparse.ArgumentParser) -> None:
    from splitserve.benchmarks import perplexity

    add_engine_args(ppl)
    perplexity.add_arguments(ppl)
    ppl.set_defaults(func=lambda ns: perplexity.main(ns, engine_args_from(ns)))


def _add_quantize(qt: argparse.ArgumentParser) -> None:
    from splitserve.entrypoints import quantize_cli

    quantize_cli.add_arguments(qt)
    qt.set_defaults(func=quantize_cli.main)


def _add_bench(bench: argparse.ArgumentParser) -> None:
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from splitserve.benchmarks import latency, multimodal, pd, quant, serve, soak, spec, startup, throughput

    tp = bench_sub.add_parser("throughput", help="offline throughput (vLLM's `bench throughput` workload)")
    add_engine_args(tp)
    throughput.add_arguments(tp)
    tp.set_defaults(func=lambda ns: throughput.main(ns, engine_args_from(ns)))

    lt = bench_sub.add_parser(
        "latency", help="latency of one batch (vLLM's `bench latency`) and the decode rate (llama-bench's tg<N>)"
    )
    add_engine_args(lt)
    latency.add_arguments(lt)
    lt.set_defaults(func=lambda ns: latency.main(ns, engine_args_from(ns)))

    sv = bench_sub.add_parser(
        "serve", help="online serving benchmark against an OpenAI-compatible server (vLLM's `bench serve`)"
    )
    serve.add_arguments(sv)
    sv.set_defaults(func=lambda ns: serve.main(ns))

    qb = bench_sub.add_parser(
        "quant",
        help="quantized variants of a model against the base, one run: "
        "perplexity, weight memory, prefill / decode throughput",
    )
    add_engine_args(qb)
    quant.add_arguments(qb)
    qb.set_defaults(func=lambda ns: quant.main(ns, engine_args_from(ns)))

    sp = bench_sub.add_parser(
        "spec", help="speculative decoding (--speculative-config) against the same engine without it, one run"
    )
    add_engine_args(sp)
    spec.add_arguments(sp)
    sp.set_defaults(func=lambda ns: spec.main(ns, engine_args_from(ns)))

    mm = bench_sub.add_parser(
        "mm", help="image requests (a vision-language model) against transformers: time to first token, throughput"
    )
    add_engine_args(mm)
    multimodal.add_arguments(mm)
    mm.set_defaults(func=lambda ns: multimodal.main(ns, engine_args_from(ns)))

    pdb = bench_sub.add_parser("pd", help="a PD deployment against one mixed instance, same workload, one run")
    pd.add_arguments(pdb)
    pdb.set_defaults(func=lambda ns: pd.main(ns))

    su = bench_sub.add_parser(
        "startup", help="time to ready of a model, served and offline, cold and warm, phase by phase"
    )
    startup.add_arguments(su)
    su.set_defaults(func=lambda ns: startup.main(ns))

    sk = bench_sub.add_parser(
        "soak",
        help="mixed traffic (aborts and invalid requests included) for a long time: memory growth of every "
        "process, KV blocks left in use, 5xx answers",
    )
    soak.add_arguments(sk)
    sk.set_defaults(func=lambda ns: soak.main(ns))


def _add_run_batch(rb: argparse.ArgumentParser) -> None:
    from splitserve.entrypoints import run_batch

    run_batch.add_arguments(rb)
    rb.set_defaults(func=run_batch.main)


def _add_env(env: argparse.ArgumentParser) -> None:
    env.add_argument(
        "--markdown", action="store_true", help="the table of docs/envs.md instead of this environment's values"
    )
    env.set_defaults(func=_cmd_env)


def _cmd_env(ns: argparse.Namespace) -> None:
    from splitserve import envs

    print(envs.markdown_table() if ns.markdown else envs.describe(), end="" if ns.markdown else "\n")


def _add_ranktable(rt: argparse.ArgumentParser) -> None:
    rt_sub = rt.add_subparsers(dest="ranktable_command", required=True)
    from splitserve.entrypoints import ranktable_cli

    rt_gen = rt_sub.add_parser("gen", help="this machine's part of the global rank table and its local tables")
    ranktable_cli.add_gen_arguments(rt_gen)
    rt_gen.set_defaults(func=ranktable_cli.gen_main)
    rt_merge = rt_sub.add_parser("merge", help="merge the machines' global rank tables into one, and validate it")
    ranktable_cli.add_merge_arguments(rt_merge)
    rt_merge.set_defaults(func=ranktable_cli.merge_main)


def _add_deploy(dp: argparse.ArgumentParser) -> None:
    dp_sub = dp.add_subparsers(dest="deploy_command", required=True)
    from splitserve.deploy import kubernetes

    k8s = dp_sub.add_parser("kubernetes", help="Kubernetes manifests (deploy/kubernetes/) with your values")
    kubernetes.add_arguments(k8s)
    k8s.set_defaults(func=kubernetes.main)


# name -> (help, the function that adds the subcommand's flags)
_SUBCOMMANDS = {
    "generate": ("generate text for a few prompts (offline)", _add_generate),
    "serve": ("the OpenAI-compatible HTTP server", _add_serve),
    "router": (
        "the prefill/decode disaggregation router (an OpenAI-compatible front for prefill and decode instances)",
        _add_router,
    ),
    "run-batch": (
        "run a file of OpenAI batch requests (/v1/completions, /v1/chat/completions) offline, as vLLM's run-batch",
        _add_run_batch,
    ),
    "perplexity": ("the model's perplexity on a text (sliding windows)", _add_perplexity),
    "quantize": (
        "quantize a model offline (weight_only_int8, smooth_quant, awq, gptq) into a Hugging Face directory",
        _add_quantize,
    ),
    "bench": ("benchmarks", _add_bench),
    "ranktable": (
        "rank tables of a prefill/decode disaggregated deployment (also spelled `--mode gen|merge`)",
        _add_ranktable,
    ),
    "deploy": ("deployment files: Kubernetes manifests for a server or a PD deployment", _add_deploy),
    "env": ("the SPLITSERVE_* environment variables: each one's value here, default and purpose", _add_env),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `splitserve` parser. With `command`, only that subcommand's flags are added (the others
    are listed with their help): each brings its own imports, and `splitserve serve` starts its
    engine process sooner without the others'."""
    parser = argparse.ArgumentParser(prog="splitserve", description="splitserve: an LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add) in _SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        if command in (None, name):
            add(sp)
    return parser


def _mode_as_subcommand(argv: list[str]) -> list[str]:
    """`ranktable --mode gen|merge ...`, as the deployment guide's pd_ranktable_tools.py is called, is
    `ranktable gen|merge ...`."""
    if argv[:1] != ["ranktable"]:
        return argv
    rest = argv[1:]
    for i, word in enumerate(rest):
        if word == "--mode" and i + 1 < len(rest):
            return ["ranktable", rest[i + 1], *rest[:i], *rest[i + 2 :]]
        if word.startswith("--mode="):
            return ["ranktable", word.split("=", 1)[1], *rest[:i], *rest[i + 1 :]]
    return argv


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(
        level=envs.SPLITSERVE_LOGGING_LEVEL.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    argv = _mode_as_subcommand(list(sys.argv[1:] if argv is None else argv))
    ns = build_parser(argv[0] if argv and argv[0] in _SUBCOMMANDS else None).parse_args(argv)
    try:
        ns.func(ns)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        logging.getLogger("splitserve").error("%s", exc)
        sys.exit(2)


def run() -> None:
    """The `splitserve` command: main() in a process that leaves without the interpreter's teardown."""
    main_and_exit(main)


if __name__ == "__main__":
    run()
