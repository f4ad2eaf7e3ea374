"""`splitserve perplexity` against transformers' own computation of the same sliding windows."""

from __future__ import annotations

import math

import pytest
import torch

from splitserve import LLM
from splitserve.benchmarks.perplexity import BUILTIN_TEXT, compute_perplexity, windows
from tests.helpers.hf_reference import load_hf_model


def _hf_perplexity(model, ids: list[int], max_length: int, stride: int) -> float:
    nll, count = 0.0, 0
    for begin, end, targets in windows(len(ids), max_length, stride):
        with torch.inference_mode():
            logits = model(torch.tensor([ids[begin:end]])).logits[0].float()
        logprobs = torch.log_softmax(logits[:-1], -1)
        window = ids[begin:end]
        for pos in range(len(window) - targets, len(window)):
            nll -= float(logprobs[pos - 1, window[pos]])
        count += targets
    return math.exp(nll / count)


def test_windows_score_every_token_once():
    spans = windows(10, 4, 2)
    assert spans == [(0, 4, 3), (2, 6, 2), (4, 8, 2), (6, 10, 2)]
    assert sum(t for *_, t in spans) == 9  # all but the first token
    assert windows(3, 8, 4) == [(0, 3, 2)]
    with pytest.raises(ValueError):
        windows(10, 4, 5)


@pytest.mark.parametrize("max_length, stride", [(512, 256), (48, 16)])
def test_perplexity_matches_transformers(tiny_chat_model, max_length, stride):
    llm = LLM(tiny_chat_model, dtype="float32", max_model_len=512, use_tqdm_on_load=False)
    ids = llm.get_tokenizer()(BUILTIN_TEXT).input_ids[:200]
    ours = compute_perplexity(llm, ids, max_length, stride)
    reference = _hf_perplexity(load_hf_model(tiny_chat_model), ids, max_length, stride)
    assert ours.num_tokens_scored == len(ids) - 1
    assert ours.perplexity == pytest.approx(reference, rel=1e-4)


@pytest.mark.slow  # two CLI processes, each importing torch and loading the model
def test_the_cli_windows_fit_max_model_len(tiny_chat_model, tmp_path):
    """The default window leaves the generated token its slot; a window as long as max_model_len is
    refused with what to change."""
    import subprocess
    import sys

    text = tmp_path / "text.txt"
    text.write_text(BUILTIN_TEXT * 3)
    command = [sys.executable, "-m", "splitserve.entrypoints.cli", "perplexity", "--model", tiny_chat_model]
    command += ["--dtype", "float32", "--max-model-len", "64", "--text-file", str(text)]
    ok = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert ok.returncode == 0, ok.stderr
    assert "windows of up to 63 tokens" in ok.stdout
    bad = subprocess.run([*command, "--max-length", "64"], capture_output=True, text=True, timeout=300, check=False)
    assert bad.returncode == 2
    assert "--max-length 64 needs --max-model-len of at least 65" in bad.stderr
