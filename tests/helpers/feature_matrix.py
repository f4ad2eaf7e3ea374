"""What the offline pairwise matrices share (tests/parity/test_feature_matrix*.py): a deployment
column, the engine a column starts, and the compatibility table's rule that refuses it."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve import LLM

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@dataclass(frozen=True)
class Column:
    name: str
    args: dict
    exact: bool  # the same numbers as the plain engine: the same answers


def engine(model: str, **args) -> LLM:
    """An engine of the matrices: float32, a short context, LoRA adapters on unless `args` say not."""
    args.setdefault("enable_lora", True)
    return LLM(model, dtype="float32", max_model_len=256, seed=0, use_tqdm_on_load=False, **args)


def close(llm: LLM) -> None:
    llm.llm_engine.shutdown()


def refusal(args: dict):
    """The compatibility table's rule that refuses this deployment at start-up, if one does."""
    from splitserve.engine import compatibility
    from splitserve.engine.arg_utils import EngineArgs
    from splitserve.engine.compatibility import CombinationRefused

    try:
        compatibility.check(EngineArgs(**args))
    except CombinationRefused as exc:
        return exc.rule
    return None
