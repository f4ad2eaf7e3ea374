"""`splitserve bench latency`: vLLM's latency figures and the decode rate compared with llama-bench's tg<N>."""

import json

import pytest

from splitserve.benchmarks import latency
from splitserve.entrypoints.cli import build_parser


def test_the_decode_rate_is_the_tokens_after_the_first_over_the_time_after_the_prompts_step():
    r = latency.LatencyResult(
        batch_size=4, input_len=128, output_len=129, latencies=[1.0, 1.3, 1.1], first_token_latencies=[0.2, 0.1, 0.5]
    )
    assert r.avg_latency == pytest.approx(3.4 / 3)
    assert r.decode_seconds == pytest.approx(1.1 - 0.2)
    assert r.decode_tokens_per_s == pytest.approx(128 / 0.9)
    assert r.percentiles() == {10: 1.0, 25: 1.0, 50: 1.1, 75: 1.3, 90: 1.3, 99: 1.3}
    one_token = latency.LatencyResult(1, 8, 1, [0.1], [0.1])
    assert one_token.decode_tokens_per_s != one_token.decode_tokens_per_s  # NaN: no token after the first


def _parse(*flags: str):
    return build_parser().parse_args(["bench", "latency", *flags])


def test_a_run_reports_every_iteration_and_the_decode_rate(tiny_models, tmp_path, capsys):
    from splitserve.entrypoints.cli import engine_args_from

    out = tmp_path / "latency.json"
    ns = _parse(
        "--model", tiny_models["llama"], "--batch-size", "2", "--input-len", "16", "--output-len", "12",
        "--num-iters", "3", "--num-iters-warmup", "1", "--output-json", str(out),
    )  # fmt: skip
    result = latency.main(ns, engine_args_from(ns))
    assert len(result.latencies) == len(result.first_token_latencies) == 3
    saved = json.loads(out.read_text())
    assert saved["latencies"] == result.latencies
    assert saved["decode_tokens_per_s"] == pytest.approx(2 * saved["decode_tokens_per_s_per_sequence"])
    assert saved["decode_tokens_per_s_per_sequence"] == pytest.approx(11 / result.decode_seconds)
    # 12 tokens take longer than 1 (medians: one iteration slowed by a busy machine must not decide it)
    assert result.decode_seconds > 0
    printed = capsys.readouterr().out
    assert "Avg latency:" in printed and "99% percentile latency:" in printed
    assert "tok/s per sequence" in printed and "llama-bench's tg12" in printed


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
        (["--num-iters", "0"], "--num-iters must be at least 1, got 0"),
        (["--num-iters-warmup", "-1"], "--num-iters-warmup must be at least 0, got -1"),
    ],
)
def test_bad_settings_are_refused_before_the_engine_starts(flags, message):
    with pytest.raises(ValueError, match=message):
        latency.main(_parse(*flags), None)
