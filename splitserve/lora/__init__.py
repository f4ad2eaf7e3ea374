"""LoRA adapters: the request that names one (request.py) and PEFT checkpoints (peft.py). The
batched application lives with the layers (layers/lora.py) and the runner (executor/lora_manager.py)."""

from splitserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
