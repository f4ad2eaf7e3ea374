"""The PD router's HTTP side: an OpenAI-compatible front for prefill and decode instances.

The app (FastAPI, aiohttp, the engine's front-end and with it torch) is imported on first use, so
that the `splitserve` command can describe its `router` flags without importing it."""

from splitserve.entrypoints.router.config import RouterConfig, add_arguments

__all__ = ["RouterConfig", "add_arguments", "build_router_app", "main", "run_router"]


def __getattr__(name: str):
    if name in ("build_router_app", "main", "run_router"):
        from splitserve.entrypoints.router import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
