"""Reference generations from Hugging Face transformers, one prompt at a time (no padding)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Reference:
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each generated token
    top5: list[list[int]]  # the 5 most likely tokens at each step
    gaps: list[float]  # logit gap between the best and second-best token at each step


def load_hf_model(path: str, dtype=torch.float32, gguf_file: str | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=dtype)
    return model.eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> Reference:
    ref = Reference([], [], [], [])
    ids = torch.tensor([prompt_ids])
    past = None
    for _ in range(max_new_tokens):
        out = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
        top = logits.topk(5)
        token = int(top.indices[0])
        ref.token_ids.append(token)
        ref.logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ref.top5.append(top.indices.tolist())
        ref.gaps.append(float(top.values[0] - top.values[1]))
        ids = torch.tensor([[token]])
    return ref


def assert_greedy_match(
    ours_ids: list[int],
    ours_logprobs: list[float] | None,
    ref: Reference,
    logprob_atol: float = 1e-4,
    tie_gap: float = 1e-4,
) -> None:
    """Greedy tokens must be identical. The one allowed exception is a near tie (the reference's
    best two logits within `tie_gap`), where the float rounding of a different but equally valid
    computation order may pick the other token; then our token must be in the reference's top 5
    and comparison stops there. Logprobs must agree within `logprob_atol`."""
    assert len(ours_ids) == len(ref.token_ids), (len(ours_ids), len(ref.token_ids))
    for step, (ours, theirs) in enumerate(zip(ours_ids, ref.token_ids)):
        if ours != theirs:
            assert ref.gaps[step] < tie_gap and ours in ref.top5[step], (
                f"diverged at step {step}: ours {ours}, transformers {theirs} (gap {ref.gaps[step]:.3g}); "
                f"ours={ours_ids} ref={ref.token_ids}"
            )
            return
        if ours_logprobs is not None:
            assert abs(ours_logprobs[step] - ref.logprobs[step]) < logprob_atol, (
                f"logprob at step {step}: ours {ours_logprobs[step]}, transformers {ref.logprobs[step]}"
            )
