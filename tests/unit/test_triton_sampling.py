"""The CUDA sampling kernel (splitserve/kernels/triton_sampling.py) against the torch sampler's
arithmetic (softmax of logits / T, cumsum, searchsorted at u * total; argmax for greedy rows; the
chosen token's logprob under the raw logits) and the CPU kernel. Without CUDA it runs in Triton's
CPU interpreter at small vocabularies and blocks (several blocks per row, so the online maximum and
sums across blocks are exercised); gpu-marked cases run the default model's and Qwen3's vocabulary
sizes in bfloat16 on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is defined (imported below)
pytest.importorskip("triton")

from splitserve import kernels  # noqa: E402
from splitserve.kernels import triton_sampling  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# A NaN or a division by zero inside the kernel is an error (the interpreter reports them)
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def _reference(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor):
    """What the torch sampler computes for a plain batch (splitserve/executor/sampler.py)."""
    raw = logits.float()
    greedy = temperature < triton_sampling.GREEDY_TEMPERATURE
    probs = torch.softmax(raw / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None], dim=-1)
    cdf = probs.cumsum(dim=-1)
    sampled = torch.searchsorted(cdf, (u[:, None] * cdf[:, -1:]).contiguous(), right=True).squeeze(1)
    tokens = torch.where(greedy, raw.argmax(dim=-1), sampled.clamp(max=raw.shape[-1] - 1))
    logprobs = torch.log_softmax(raw, dim=-1).gather(-1, tokens[:, None]).squeeze(1)
    return tokens, logprobs


def _case(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.1
    temperature[::3] = 0.0  # every third row greedy
    u = torch.rand(rows, generator=gen)
    return logits.to(DEVICE), temperature.to(DEVICE), u.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab,block", [(1000, 128), (333, 64), (50, 64)])
def test_kernel_samples_what_the_torch_sampler_does(monkeypatch, dtype, vocab, block):
    monkeypatch.setattr(triton_sampling, "MAX_BLOCK", block)
    logits, temperature, u = _case(7, vocab, dtype)
    tokens, logprobs = triton_sampling.sample(logits, temperature, u)
    want_tokens, want_logprobs = _reference(logits, temperature, u)
    assert tokens.tolist() == want_tokens.tolist()
    torch.testing.assert_close(logprobs, want_logprobs, atol=1e-4, rtol=1e-4)


def test_all_greedy_batches_take_the_first_maximum(monkeypatch):
    monkeypatch.setattr(triton_sampling, "MAX_BLOCK", 32)
    logits = torch.zeros(3, 100)
    logits[0, [5, 70]] = 2.0  # a tie across blocks: the first
    logits[1, [40, 41]] = 1.0  # a tie inside a block
    logits[2, 99] = -1.0  # every other logit equal: token 0
    tokens, logprobs = triton_sampling.sample(logits.to(DEVICE), torch.zeros(3, device=DEVICE), None, all_greedy=True)
    assert tokens.tolist() == [5, 40, 0]
    torch.testing.assert_close(logprobs.cpu(), torch.log_softmax(logits, -1)[[0, 1, 2], [5, 40, 0]])


def test_banned_tokens_are_never_drawn_and_u_at_the_top_stays_in_the_vocabulary(monkeypatch):
    monkeypatch.setattr(triton_sampling, "MAX_BLOCK", 16)
    logits = torch.randn(4, 40)
    logits[:, 30:] = float("-inf")  # the tail has no mass
    temperature = torch.ones(4)
    u = torch.tensor([0.0, 0.5, 0.999999, 1.0])
    tokens, _ = triton_sampling.sample(logits.to(DEVICE), temperature.to(DEVICE), u.to(DEVICE))
    assert all(0 <= t < 30 for t in tokens.tolist())
    assert tokens[0].item() == 0  # u = 0: the first token with any weight


def test_the_cuda_and_cpu_kernels_agree_and_kernels_routes_both():
    logits, temperature, u = _case(5, 700, torch.float32, seed=3)
    gpu_like = triton_sampling.sample(logits, temperature, u)
    if kernels.sample_supported(logits.cpu()):  # the C++ kernel where it builds
        cpu = kernels.sample(logits.cpu(), temperature.cpu(), u.cpu())
        assert cpu[0].tolist() == gpu_like[0].cpu().tolist()
        torch.testing.assert_close(cpu[1], gpu_like[1].cpu(), atol=1e-4, rtol=1e-4)
    assert not kernels.sample_supported(logits.cpu()[:, ::2])  # a strided vocabulary is not taken


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("vocab", [49152, 151936])
@pytest.mark.parametrize("rows", [1, 64])
def test_gpu_kernel_samples_what_the_torch_sampler_does(vocab, rows):
    logits, temperature, u = _case(rows, vocab, torch.bfloat16, seed=vocab + rows)
    assert kernels.sample_supported(logits)
    tokens, logprobs = kernels.sample(logits, temperature, u)
    want_tokens, want_logprobs = _reference(logits, temperature, u)
    # float32 sums in another order: a draw on a boundary may fall one token over, nothing more
    assert (tokens == want_tokens).float().mean().item() >= 0.95
    same = tokens == want_tokens
    torch.testing.assert_close(logprobs[same], want_logprobs[same], atol=2e-3, rtol=1e-3)
