"""Clipping for 4-bit rounding with a zero point: a group's range [min, max] shrunk toward zero before
its scale and zero point are fitted, so that rounding a few outliers harder buys a finer grid for the
rest. AWQ's search (algorithms.awq_clip_search) weighs the rounding error by its inputs' statistics
and searches each end of the range with `search_clip_ratios`. GPTQ's (gptq.clip_searched_params)
shrinks both ends by one ratio: searched by end, its groups fit the calibration Hessian better and
the model came out worse (default model, group 64, held-out prose and code: 21.713 / 7.663 against
21.424 / 7.569), its later columns' error updates being made for the range it chose first."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from splitserve.quantization.packing import Int4Weight, quantize_int4


def clipped_int4_params(
    weight: torch.Tensor, group_size: int, ratio: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4's (scale, zero) per group, [out, in / group_size], with the range [min, max] of
    each (row, group) scaled by ratio: [out, G] for both ends, or [out, G, 2] (minimum, maximum)."""
    out_features, in_features = weight.shape
    grouped = weight.float().reshape(out_features, in_features // group_size, group_size)
    return _params(grouped, *((ratio[..., 0], ratio[..., 1]) if ratio.dim() == 3 else (ratio, ratio)))


def _params(grouped: torch.Tensor, low_ratio: torch.Tensor, high_ratio: torch.Tensor):
    """(scale, zero) of each group of `grouped` [..., size] over its range with each end scaled."""
    lo = grouped.amin(dim=-1).clamp(max=0.0) * low_ratio
    hi = grouped.amax(dim=-1).clamp(min=0.0) * high_ratio
    scale = ((hi - lo) / 15.0).clamp(min=1e-8)
    return scale, torch.round(-lo / scale).clamp(0, 15)


def quantize_int4_clipped(weight: torch.Tensor, group_size: int, ratio: torch.Tensor) -> Int4Weight:
    """Asymmetric int4 per group with the range [min, max] of each (row, group) scaled by ratio."""
    scale, zero = clipped_int4_params(weight, group_size, ratio)
    return Int4Weight(
        quantize_int4(weight, scale, zero, group_size=group_size), scale, zero.to(torch.int32), group_size
    )


def rounding_error(grouped: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """What rounding each group of `grouped` [out, G, size] over its clipped range gets wrong, for a
    batch of candidate ratios [K, out, G, 2]: [K, out, G, size] (the searches' inner step)."""
    scale, zero = (t[..., None] for t in _params(grouped, ratio[..., 0], ratio[..., 1]))
    return (torch.round(grouped / scale + zero).clamp_(0, 15) - zero) * scale - grouped


def search_clip_ratios(
    loss_of: Callable[[torch.Tensor], torch.Tensor], shape: Sequence[int], steps: Sequence[float]
) -> torch.Tensor:
    """Per element of `shape` (a row's group), the ratios (of the minimum, of the maximum) [*shape, 2]
    with the least loss found by coordinate descent over `steps`: both ends shrunk by one ratio
    (AutoAWQ's search), then the maximum alone with the minimum where it landed, then the minimum
    alone. `loss_of` takes candidates [K, *shape, 2] and returns their losses [K, *shape]; it is given
    one at a time (K = 1): batched, the [K, out, in] errors leave the caches, 3x slower on 2 cores.
    A group's outliers are often on one side, where shrinking the other end too only coarsens its
    grid: on the default model at group 64 this took AWQ's perplexity on held-out prose and code
    2.9% and 3.0% lower than one ratio for both. Each step is kept only where it lowers the loss, and
    the full range (1, 1) is the start, so the result never loses to it."""
    best = torch.ones(*shape, 2)
    best_loss = loss_of(best[None])[0]
    grid = torch.tensor(list(steps), dtype=torch.float32).reshape(-1, *[1] * len(shape), 1)
    for ends in ([0, 1], [1], [0]):
        candidates = best.expand(grid.shape[0], *best.shape).clone()
        candidates[..., ends] = grid
        losses = torch.cat([loss_of(candidate) for candidate in candidates.split(1)])
        pick = losses.argmin(dim=0, keepdim=True)
        loss = losses.gather(0, pick)[0]
        chosen = candidates.gather(0, pick[..., None].expand(1, *shape, 2))[0]
        better = loss < best_loss
        best_loss = torch.where(better, loss, best_loss)
        best = torch.where(better[..., None], chosen, best)
    return best
