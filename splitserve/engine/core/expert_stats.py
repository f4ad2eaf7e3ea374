"""MoE models: how many tokens each expert has been routed, for /metrics (the dashboard's expert-load
bars, and an operator's view of routing skew).

The counts live in the model's MoE layers on every rank (layers/moe.py); asking for them is a call
to every rank, and on a GPU a copy from the device, so the stats ask at most every REFRESH_S seconds.
A dense model answers nothing the first time and is not asked again."""

from __future__ import annotations

import time

REFRESH_S = 5.0


class ExpertLoadWatch:
    def __init__(self, executor):
        self.executor = executor
        self.load: list[int] | None = None  # tokens routed to each expert since start, summed over layers
        self.asked_at = -REFRESH_S
        self.dense = False

    def snapshot(self) -> list[int] | None:
        now = time.monotonic()
        if self.dense or now - self.asked_at < REFRESH_S:
            return self.load
        self.asked_at = now
        layers = self.executor.expert_load()
        if not layers:
            self.dense = True
            return None
        self.load = [sum(per_layer) for per_layer in zip(*layers.values())]
        return self.load
