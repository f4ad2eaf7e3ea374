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

    from splitserve.loader.gguf_cache import gguf_parsed_once
    from splitserve.loader.hf_model import gguf_name_maps_built_once

    with gguf_name_maps_built_once(), gguf_parsed_once():  # the config's read and the weights' share a parse
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


@torch.inference_mode()
def teacher_forced_logprobs(model, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] float32 log-probabilities of the model's next token after the prompt
    and after each of token_ids[:-1], in one forward pass (model: called with input_ids on the CPU)."""
    ids = torch.tensor([list(prompt_ids) + list(token_ids[:-1])])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 :].float()
    return torch.log_softmax(logits, -1).cpu()


def assert_as_accurate_as_reference(
    ours: list[tuple[list[int], list[float]]], exact: list[torch.Tensor], reference: list[torch.Tensor], slack: float
) -> dict:
    """16-bit greedy generations judged against float32 rather than against another 16-bit one.

    Two correct 16-bit computations that round at different places drift apart over a sequence
    (on a random model whose best logits are close, a first differing token sends the rest of the
    texts apart), so token-for-token equality with transformers in 16 bits says little either way.
    Instead, along our own tokens (teacher forcing), for each prompt: ours = (token ids, their
    log-probabilities), `exact` the float32 log-probabilities of the same weights and `reference`
    transformers' in our dtype (both [steps, vocab]). Transformers' own error tells how far 16-bit
    rounding moves log-probabilities on this model; over all the prompts together (one sequence's
    worst step is a noisy figure in bfloat16): the mean error of our tokens' log-probabilities within
    1.5 times transformers' (plus slack / 5), the largest within twice its largest (plus `slack`), and
    a greedy choice of ours may trail float32's best by no more than that bound either (or than twice
    as far as transformers' own choices trail it).
    Returns the figures, which also go into any failure's message."""
    ids = torch.tensor([t for token_ids, _ in ours for t in token_ids])
    ours_lp = torch.tensor([lp for _, logprobs in ours for lp in logprobs])
    exact, reference = torch.cat(exact), torch.cat(reference)
    steps = torch.arange(len(ids))
    exact_chosen, best = exact[steps, ids], exact.max(-1).values
    ref_err, our_err = (reference[steps, ids] - exact_chosen).abs(), (ours_lp - exact_chosen).abs()
    figures = {
        "steps": len(ids),
        "reference_mean_error": float(ref_err.mean()),
        "our_mean_error": float(our_err.mean()),
        "reference_error": float(ref_err.max()),
        "our_error": float(our_err.max()),
        "reference_margin": float((best - exact[steps, reference.argmax(-1)]).max()),
        "our_margin": float((best - exact_chosen).max()),
    }
    bound = 2 * max(figures["reference_error"], figures["reference_margin"]) + slack
    figures["bound"] = bound
    assert figures["our_mean_error"] <= 1.5 * figures["reference_mean_error"] + slack / 5, (
        f"our log-probabilities are further from float32 on average: {figures}"
    )
    assert figures["our_error"] <= bound, f"our log-probabilities are further from float32: {figures}"
    assert figures["our_margin"] <= bound, f"a greedy choice trails float32's best too far: {figures}"
    return figures
