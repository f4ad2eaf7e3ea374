"""Sleep mode at the engine (vLLM's LLM.sleep / wake_up / is_sleeping, and reset_prefix_cache): an
idle engine hands its accelerator memory back between rollouts of a reinforcement-learning loop
and takes it again, ready to serve as before (executor/sleep_mode.py says what each rank does).

An engine sleeps only when idle: a request in it, a KV lease of a PD prefill instance or a pull
of a decode instance makes sleep refuse, naming them. Requests sent while it sleeps are refused
(EngineAsleepError, 503 at the server). Waking allocates an empty KV cache: the prefix cache starts
empty, as after start-up; CUDA graphs are captured again and, after level 2, the LoRA adapters in
use are read again. A PD instance's KV connector lets go of the cache and takes the new one."""

from __future__ import annotations

import logging
import time

from splitserve.engine.errors import EngineAsleepError

logger = logging.getLogger(__name__)


class EngineSleep:
    def __init__(self, core):
        self.core = core
        self.level = 0

    def check_awake(self) -> None:
        if self.level:
            raise EngineAsleepError(
                f"The engine is asleep (level {self.level}): wake it first (POST /wake_up, LLM.wake_up())."
            )

    def sleep(self, level: int) -> None:
        core = self.core
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}.")
        if self.level:
            raise ValueError(f"The engine is already asleep (level {self.level}).")
        self.check_idle("sleeping")
        start = time.perf_counter()
        core.executor.sleep(level)
        if core.connector is not None:  # a PD instance: its KV connector lets go of the released cache
            core.connector.rebind()
        core.kv_manager.pool.reset_prefix_cache()
        self.level = level
        logger.info(
            "Engine asleep (level %d: KV cache released, weights %s) in %.2f s",
            level,
            "dropped" if level == 2 else "in host memory",
            time.perf_counter() - start,
        )

    def check_idle(self, action: str) -> None:
        """Refuse (ValueError) to drop the runner while a request is in the engine, or while a PD
        instance has KV leased or being pulled. A draft model sleeps with its runner, a PD instance's
        KV connector and a KV offloading tier follow the cache (rebind)."""
        core = self.core
        sched = core.scheduler
        if sched.leased or sched.receiving:  # a PD instance's KV on its way out or in
            raise ValueError(
                f"{len(sched.leased)} KV lease(s) and {len(sched.receiving)} KV pull(s) are open: wait until the "
                f"decode instances have pulled (or the leases expired) before {action}."
            )
        busy = len(sched.requests) + len(core.structured_output.compiling) + (core._in_flight is not None)
        if busy:
            raise ValueError(f"{busy} request(s) are in the engine: let them finish or abort them before {action}.")

    def wake_up(self, weights: tuple[str, str] | None = None) -> None:
        """`weights` (path, load format), after level 2: the checkpoint to read instead of the
        model's own (engine/core/weight_update.py)."""
        core = self.core
        if not self.level:
            return
        start = time.perf_counter()
        cc = core.config.cache_config
        core.executor.wake_up(cc.num_gpu_blocks, cc.num_cpu_blocks, weights)
        core.executor.capture_cuda_graphs()
        if core.connector is not None:
            core.connector.rebind()
        if self.level == 2:
            for lora in core.loras.list():
                core.executor.add_lora(lora)
        self.level = 0
        logger.info("Engine awake in %.2f s", time.perf_counter() - start)

    def update_weights(self, model_path: str, load_format: str = "auto") -> float:
        """Load a new checkpoint of the same model (engine/core/weight_update.py); the seconds it took."""
        from splitserve.engine.core.weight_update import update_weights

        return update_weights(self.core, model_path, load_format)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (after the weights changed); False while requests hold blocks."""
        return self.core.kv_manager.pool.reset_prefix_cache()
