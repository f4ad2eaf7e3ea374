"""The table of refused feature combinations (engine/compatibility.py): every start-up rule refuses
its example before anything starts, in one line naming both features, and lets the example start
without its second feature; docs/compatibility.md is the table."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.engine import compatibility
from splitserve.engine.arg_utils import EngineArgs

DOCS = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"
START_UP = [rule for rule in compatibility.RULES if rule.applies is not None]


@pytest.mark.parametrize("rule", START_UP, ids=lambda r: r.name)
def test_each_start_up_rule_refuses_its_example_and_only_that(rule):
    with pytest.raises(compatibility.CombinationRefused) as info:
        compatibility.check(EngineArgs(**rule.example))
    assert info.value.rule is rule and isinstance(info.value, ValueError)
    message = str(info.value)
    assert message.startswith(f"{rule.first} with {rule.second}: ") and "\n" not in message
    compatibility.check(EngineArgs(**rule.without_second))  # one feature alone is no refusal
    assert set(rule.without_second) < set(rule.example)


def test_the_refusal_reaches_start_up_before_the_model_is_read(tmp_path):
    rule = START_UP[0]
    args = EngineArgs(model=str(tmp_path / "no-such-model"), **rule.example)
    with pytest.raises(compatibility.CombinationRefused):
        args.create_engine_config()


def test_rules_raised_by_the_code_that_knows_carry_the_tables_words():
    assert {r.name for r in compatibility.RULES} >= {"global_scheduler+pd", "pooling+pd_role"}
    error = compatibility.refusal("global_scheduler+pd")
    assert str(error) == error.rule.message() and error.rule.applies is None
    names = [r.name for r in compatibility.RULES]
    assert len(names) == len(set(names))


def test_docs_hold_the_table():
    assert compatibility.markdown_table() in DOCS.read_text(), (
        "docs/compatibility.md is stale: put `splitserve.engine.compatibility.markdown_table()` in it"
    )


@pytest.mark.parametrize(
    "flags, name",
    [
        (["--pd-role", "prefill", "--scheduler-name", "global"], "global_scheduler+pd"),
        (["--pd", "1p1d", "--scheduler-name", "global"], "global_scheduler+pd"),
        (["--data-parallel-size", "2", "--pd-role", "decode"], "data_parallel+pd"),
        (["--data-parallel-size", "2", "--scheduler-name", "global"], "data_parallel+global_scheduler"),
    ],
)
def test_server_flag_combinations_are_refused_with_the_tables_words_before_anything_is_reached(flags, name):
    """The global scheduler's Redis is not there: the refusal comes first, in the table's words."""
    from splitserve.entrypoints.openai.args import make_arg_parser, split_args

    with pytest.raises(compatibility.CombinationRefused) as info:
        split_args(make_arg_parser().parse_args(flags))
    assert info.value.rule.name == name
