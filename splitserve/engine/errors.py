"""Errors the engine raises for input it refuses, and for an engine that is not running. Kept free
of imports so that the HTTP layers (the API server and the router) can map them without loading the
engine."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request that cannot be served as given: the caller's mistake, not the engine's. `param`
    names the part at fault (OpenAI's error `param`), so that the API server answers 400 with it.
    A ValueError, so that offline callers that catch ValueError keep working."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status  # 404 for a model or adapter that is not there
        self.request_id: str | None = None  # set when the engine refused a request it had been sent

    @property
    def err_type(self) -> str:
        if self.status == 503:
            return "service_unavailable"
        return "not_found_error" if self.status == 404 else "invalid_request_error"


class EngineAsleepError(ValueError):
    """A request sent to an engine that sleeps (LLM.sleep, POST /sleep): it is refused, 503."""


class EngineDeadError(RuntimeError):
    """The API server's engine process is not running (it died, or is being restarted): 503."""
