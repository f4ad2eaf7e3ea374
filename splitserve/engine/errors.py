"""Errors the engine raises for input it refuses. Kept free of imports so that the HTTP layers
(the API server and the router) can map them without loading the engine."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request that cannot be served as given: the caller's mistake, not the engine's. `param`
    names the part at fault (OpenAI's error `param`), so that the API server answers 400 with it.
    A ValueError, so that offline callers that catch ValueError keep working."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
