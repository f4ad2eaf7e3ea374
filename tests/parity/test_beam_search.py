"""Beam search (LLM.beam_search) gives the sequences of transformers' generate(num_beams=...) on
tiny float32 models, across beam widths, length penalties and the three early_stopping rules. The
models' end-of-sequence token is set to one they produce often, so that hypotheses do end early
and the finished-hypothesis bookkeeping is exercised, not only the length limit."""

from __future__ import annotations

import collections
import json
import os
import shutil

import pytest
import torch

from splitserve import LLM, BeamSearchParams, SamplingParams
from tests.helpers.hf_reference import load_hf_model

PROMPTS = [[5 + i + 3 * j for j in range(6 + 2 * i)] for i in range(4)]
ENDED_EARLY: dict[str, int] = {}  # per model: hypotheses that ended with eos, over all cases
CASES = [(3, 1.0, False, 12), (4, 0.5, True, 10), (2, 2.0, "never", 8), (5, 1.0, False, 16), (3, -1.0, "never", 9)]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_with_frequent_eos(request, tiny_models, tmp_path_factory) -> tuple[str, int]:
    """A copy of a tiny model whose eos is the token its greedy outputs hold most often."""
    source = tiny_models[request.param]
    llm = LLM(source, dtype="float32", max_model_len=128, use_tqdm_on_load=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=24))
    eos = collections.Counter(t for o in outs for t in o.outputs[0].token_ids).most_common(1)[0][0]
    path = str(tmp_path_factory.mktemp(f"eos_{request.param}"))
    shutil.copytree(source, path, dirs_exist_ok=True)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["eos_token_id"] = eos
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:  # where both engines read eos
        json.dump({"eos_token_id": eos, "bos_token_id": 1}, f)
    return path, eos


def _hf_beams(model, prompt, width, lp, early, max_new, eos: list[int]) -> list[list[int]]:
    out = model.generate(
        torch.tensor([prompt]),
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=max_new,
        length_penalty=lp,
        early_stopping=early,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos[0],
    )
    beams = []
    for row in out.tolist():
        generated = row[len(prompt) :]
        end = next((i + 1 for i, t in enumerate(generated) if t in eos), len(generated))
        beams.append(prompt + generated[:end])
    return beams


@pytest.mark.parametrize("width, length_penalty, early_stopping, max_tokens", CASES)
def test_beam_search_matches_transformers(model_with_frequent_eos, width, length_penalty, early_stopping, max_tokens):
    path, frequent = model_with_frequent_eos
    eos = [frequent, 2]  # the engine stops at the tokenizer's eos (2) and at generation_config's
    llm = LLM(path, dtype="float32", max_model_len=128, use_tqdm_on_load=False, num_gpu_blocks_override=256)
    params = BeamSearchParams(
        beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty, early_stopping=early_stopping
    )
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    hf = load_hf_model(path)
    ended_early = 0
    for prompt, output in zip(PROMPTS, outputs):
        expected = _hf_beams(hf, prompt, width, length_penalty, early_stopping, max_tokens, eos)
        assert [s.tokens for s in output.sequences] == expected
        ended_early += sum(s.finish_reason == "stop" for s in output.sequences)
        assert all(s.tokens[: len(prompt)] == prompt for s in output.sequences)
    ENDED_EARLY[path] = ENDED_EARLY.get(path, 0) + ended_early


def test_some_hypotheses_ended_with_eos():
    """Guards the test itself: with each model, some of the cases above must have ended hypotheses
    with eos, or they would check only the length limit."""
    assert len(ENDED_EARLY) == 2 and all(count > 0 for count in ENDED_EARLY.values()), ENDED_EARLY
