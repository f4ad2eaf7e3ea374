"""The PD router's HTTP side: an OpenAI-compatible front for prefill and decode instances."""

from splitserve.entrypoints.router.app import build_router_app, main, run_router
from splitserve.entrypoints.router.config import RouterConfig, add_arguments

__all__ = ["RouterConfig", "add_arguments", "build_router_app", "main", "run_router"]
