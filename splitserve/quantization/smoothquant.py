"""SmoothQuant for `splitserve quantize --quant-type smooth_quant`: W8A8, int8 weights with a scale
per output row and int8 activations with a scale per token at run time (linear.W8A8Int8Method).

Per input channel j of a group of linears that read one input, s_j = max|X_j|^a / max|W_j|^(1-a)
moves activation outliers (hard for per-token int8) into the weights (easy for per-row int8), and
1/s is folded into the op before (algorithms.fold_scales), so the float model does not change.

The strength a trades one rounding error for the other, and no fixed value transfers between
layers: on SmolLM2-135M, a = 0.8 everywhere cost 0.4% perplexity on prose like the calibration text
but 3-6% on other English text, almost all of it from the smoothed weights, not the activations.
`-sq NUMBER` (AIAK's flag) still applies that one strength to every group, as its document says;
`-sq auto` (the default) is the search below.
down_proj's inputs are sparse, so a few hundred calibration tokens leave many of its channels
nearly silent; their s comes out small, their weight columns shrink against the row's int8 scale,
and another text that wakes them meets coarsely rounded weights. So each group takes the strength
of `strengths(alpha)` whose error on held-out calibration text is smallest: the calibration tokens
are cut into SEARCH_FOLDS contiguous folds, and each fold's inputs go through the run-time W8A8
product with scales fitted to the other folds' maxima. The scales folded in the end use all tokens.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from splitserve.quantization.algorithms import InputGroup, decoder_groups, fold_scales
from splitserve.quantization.calibration import InputStats, run_with_input_hooks
from splitserve.quantization.linear import quantize_per_token
from splitserve.quantization.packing import quantize_int8_per_channel

SEARCH_FOLDS = 3
STRENGTH_STEP = 0.05
AUTO_MAX_STRENGTH = 0.8  # `-sq auto` searches 0, 0.05, ... up to this
# The search computes a W8A8 product per fold, group and strength, so it measures the error on a
# sample: at most this many calibration tokens (every k-th) and output rows (every k-th row of the
# group's stacked weight; rows are rounded independently, so a sample of them ranks the strengths
# as all of them would, with some noise). The maxima and the scales use all tokens and rows.
SEARCH_TOKENS = 2048
SEARCH_ROWS = 256


def strengths(alpha: float) -> list[float]:
    """The strengths searched: 0 (no smoothing), STRENGTH_STEP, ... up to alpha, and alpha."""
    grid = [round(k * STRENGTH_STEP, 6) for k in range(int(alpha / STRENGTH_STEP + 1e-6) + 1)]
    return sorted(set(grid) | {alpha})


def smoothing_scales(act_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1 - alpha); dead channels keep s = 1."""
    s = act_absmax.pow(alpha) / w_absmax.pow(1.0 - alpha)
    alive = (act_absmax > 0) & (w_absmax > 0)
    return torch.where(alive, s, torch.ones_like(s)).clamp(min=1e-5)


def w8a8_error(x: torch.Tensor, weight: torch.Tensor, reference: torch.Tensor, s: torch.Tensor) -> float:
    """Sum of squared differences between the run-time W8A8 product of x / s and W diag(s) (per-token
    and per-row int8, as linear.W8A8Int8Method computes it) and the float `reference` x W^T."""
    xq, x_scale = quantize_per_token(x / s)
    wq, w_scale = quantize_int8_per_channel(weight * s)
    product = (xq.float() @ wq.float().t()).mul_(x_scale).mul_(w_scale)
    return (product - reference).pow_(2).sum().item()


class HeldOutErrors:
    """Accumulates, per group and strength, the W8A8 output error on each fold of the calibration
    tokens with the scales fitted to the other folds (`record` is a calibration input hook)."""

    def __init__(self, groups: dict[str, InputGroup], stats: dict[str, InputStats], grid: list[float], stride: int):
        self.groups, self.grid, self.stride = groups, grid, stride
        self.rows = {
            site: math.ceil(sum(m.out_features for m in g.linears.values()) / SEARCH_ROWS) for site, g in groups.items()
        }
        self.w_absmax = {site: g.tied_max(g.weight().abs().amax(dim=0)) for site, g in groups.items()}
        self.fits = {site: g.tied_max(_held_out_maxima(stats[site])) for site, g in groups.items()}
        self.errors = {site: torch.zeros(len(grid), dtype=torch.float64) for site in groups}

    def record(self, site: str, x: torch.Tensor, fold: torch.Tensor) -> None:
        x, fold = x[:: self.stride], fold[:: self.stride]
        weight = self.groups[site].weight()[:: self.rows[site]]
        for k in fold.unique().tolist():
            xk = x[fold == k]
            reference = xk @ weight.t()
            for i, alpha in enumerate(self.grid):
                s = smoothing_scales(self.fits[site][k], self.w_absmax[site], alpha)
                self.errors[site][i] += w8a8_error(xk, weight, reference, s)

    def best(self) -> dict[str, float]:
        """The strength of least held-out error per group (the weakest among equals)."""
        return {site: self.grid[int(torch.argmin(errors))] for site, errors in self.errors.items()}


def _held_out_maxima(stats: InputStats) -> torch.Tensor:
    """[folds, in]: per fold, the channel maxima of all the other folds (of all tokens with one fold)."""
    folds = stats.fold_absmax
    if folds is None or folds.shape[0] == 1:
        return stats.absmax[None]
    return torch.stack([torch.cat([folds[:k], folds[k + 1 :]]).amax(dim=0) for k in range(folds.shape[0])])


def choose_strengths(
    model: nn.Module, groups: dict[str, InputGroup], stats: dict[str, InputStats], sequences, alpha: float
) -> dict[str, float]:
    """Each group's strength of least held-out W8A8 error (one more pass of the float model)."""
    grid = strengths(alpha)
    if len(grid) == 1:
        return dict.fromkeys(groups, grid[0])
    tokens = sum(map(len, sequences))
    search = HeldOutErrors(groups, stats, grid, stride=max(1, math.ceil(tokens / SEARCH_TOKENS)))
    folds = next(iter(stats.values())).fold_absmax
    sites = {site: next(iter(g.linears.values())) for site, g in groups.items()}
    run_with_input_hooks(
        model, sites, sequences, search.record, 1 if folds is None else folds.shape[0], desc="SmoothQuant strengths"
    )
    return search.best()


def smooth_model(model: nn.Module, stats: dict[str, InputStats], sequences, alpha: float | None) -> dict[str, float]:
    """Fold smoothing scales, computed from all the calibration tokens, into every foldable group:
    with strength `alpha` everywhere, or (alpha None, `-sq auto`) with each group's strength chosen
    by `choose_strengths` up to AUTO_MAX_STRENGTH, for which `stats` must hold every group's input
    with SEARCH_FOLDS folds. Returns the strengths by group site."""
    groups = {g.site: g for layer in decoder_groups(model) for g in layer if g.prev is not None}
    if alpha is None:
        chosen = choose_strengths(model, groups, stats, sequences, AUTO_MAX_STRENGTH)
    else:
        chosen = dict.fromkeys(groups, alpha)
    for site, group in groups.items():
        act_absmax = group.tied_max(stats[site].absmax)
        w_absmax = group.tied_max(group.weight().abs().amax(dim=0))
        fold_scales(group, smoothing_scales(act_absmax, w_absmax, chosen[site]))
    return chosen
