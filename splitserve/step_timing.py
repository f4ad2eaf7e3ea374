"""Where the host's time goes in each engine step: a lap timer read by `splitserve bench throughput
--step-breakdown` (and `--profile`).

The engine's loop calls `lap(phase)` at the end of each of its phases; each call charges the time since
the previous lap (of any phase) to `phase`. Off by default: `lap` then costs one global read. The
phases, in a step's order:

- scheduling: the scheduler's plan, and advancing its requests once the step is launched;
- step input: the plan turned into the runners' message (engine/core/step_input_builder.py);
- input preparation: the runner's rows, InputBatch, attention metadata, input tensors;
- forward: the model (on a GPU, queuing its kernels; on a CPU, computing it);
- sampling: logits, sampling metadata and the sampler (likewise queued on a GPU);
- waiting for the device: collecting a step's tokens, the time the host waits for the GPU;
- update: the tokens recorded in the requests, stop checks, the core's outputs;
- output processing: the front-end's RequestOutputs (detokenizing, stop strings, logprobs);
- other: the rest of the front-end's loop.

With worker processes (tensor/pipeline parallelism) the runner's phases happen in the ranks: the engine
process sees them inside "step input" (the launch) and "waiting for the device"."""

from __future__ import annotations

import time

PHASES = (
    "scheduling",
    "step input",
    "input preparation",
    "forward",
    "sampling",
    "waiting for the device",
    "update",
    "output processing",
    "other",
)


class StepTimer:
    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self.rows = 0  # requests summed over the steps (a decode of 256 requests: 256)
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self.last
        self.last = now

    def step(self, num_rows: int) -> None:
        self.steps += 1
        self.rows += num_rows

    def report(self) -> str:
        """A table of each phase's time per step and per request-step, and its share."""
        total = sum(self.seconds.values()) or 1e-12
        steps, rows = max(self.steps, 1), max(self.rows, 1)
        lines = [
            f"Host time per engine step ({self.steps} steps, {self.rows / steps:.1f} requests per step on average):",
            f"{'phase':<24} {'ms/step':>8} {'us/request':>11} {'share':>6}",
        ]
        for phase in PHASES:
            seconds = self.seconds[phase]
            lines.append(
                f"{phase:<24} {1e3 * seconds / steps:8.3f} {1e6 * seconds / rows:11.2f} {100 * seconds / total:5.1f}%"
            )
        lines.append(f"{'total':<24} {1e3 * total / steps:8.3f} {1e6 * total / rows:11.2f} {100.0:5.1f}%")
        return "\n".join(lines)


_timer: StepTimer | None = None


def lap(phase: str) -> None:
    """Charge the time since the previous lap to `phase` (nothing when timing is off)."""
    if _timer is not None:
        _timer.lap(phase)


def count_step(num_rows: int) -> None:
    if _timer is not None:
        _timer.step(num_rows)


def start() -> StepTimer:
    """Start timing (a fresh timer) in this process."""
    global _timer
    _timer = StepTimer()
    return _timer


def stop() -> StepTimer | None:
    global _timer
    timer, _timer = _timer, None
    return timer
