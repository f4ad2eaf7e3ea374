"""The PD router's HTTP side: an OpenAI-compatible front for prefill and decode instances."""
from splitserve.entrypoints.router.router import (RouterConfig, add_arguments, build_router_app, main,
                                                  run_router)

__all__ = ["RouterConfig", "add_arguments", "build_router_app", "main", "run_router"]
