"""The browser pages of `splitserve serve` and of the PD router: a chat page at `GET /` and a live
dashboard at `GET /dashboard` (docs/ui.md), with their static files under `/ui/`.

The pages are plain HTML, CSS and ES modules (static/), served as they are: no build step. The
third-party libraries they use (marked for Markdown, DOMPurify to sanitise it, uPlot for charts)
come from the npm registry at set-up (`make setup` copies them into static/vendor/, git-ignored);
without them the pages still load and say what is missing, and the server logs one warning.

The pages hold no secret, so they and their static files are served without the API key; the
API calls they make send the key the user typed (Authorization: Bearer)."""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

logger = logging.getLogger("splitserve.ui")

STATIC_DIR = Path(__file__).resolve().with_name("static")
STATIC_PREFIX = "/ui"
KINDS = ("server", "router")
# The files `make setup` copies from ui/node_modules (Makefile), and what the pages lose without them.
VENDOR_FILES = {
    "marked.js": "Markdown rendering (answers are shown as plain text)",
    "purify.js": "HTML sanitising (answers are shown as plain text)",
    "uplot.js": "charts (the dashboard shows numbers only)",
    "uplot.css": "chart styles",
}
# The pages run only their own scripts and talk only to this server: model output that slipped
# through sanitising could not run a script nor load a remote image.
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'self'"
)
_warned = False


def missing_vendor_files() -> list[str]:
    return [name for name in VENDOR_FILES if not (STATIC_DIR / "vendor" / name).is_file()]


def _warn_missing_once() -> None:
    global _warned
    missing = missing_vendor_files()
    if missing and not _warned:
        _warned = True
        lost = sorted({VENDOR_FILES[name] for name in missing})
        logger.warning(
            "The web UI's libraries are missing (%s under %s): the pages work without %s. Run `make setup` "
            "(npm ci --prefix ui) to install them.",
            ", ".join(missing),
            STATIC_DIR / "vendor",
            "; ".join(lost),
        )


def add_ui_routes(app: FastAPI, *, dashboard_kind: str = "server", enabled: bool = True) -> tuple[str, ...]:
    """Mount the chat page (`/`), the dashboard (`/dashboard`, of a "server" or of a "router") and
    their static files (`/ui/...`) on `app`, out of the OpenAPI document. Returns the paths that
    need no API key (none when `enabled` is False: --disable-ui, and `/` stays a 404)."""
    if dashboard_kind not in KINDS:
        raise ValueError(f"dashboard_kind must be one of {KINDS}, got {dashboard_kind!r}")
    if not enabled:
        return ()
    _warn_missing_once()
    chat = _page("chat.html", dashboard_kind)
    dashboard = _page("dashboard.html", dashboard_kind)

    async def chat_page() -> HTMLResponse:
        return HTMLResponse(chat, headers={"Content-Security-Policy": _CSP, "Cache-Control": "no-cache"})

    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(dashboard, headers={"Content-Security-Policy": _CSP, "Cache-Control": "no-cache"})

    app.add_api_route("/", chat_page, methods=["GET"], include_in_schema=False, name="ui chat")
    app.add_api_route("/dashboard", dashboard_page, methods=["GET"], include_in_schema=False, name="ui dashboard")
    app.mount(STATIC_PREFIX, StaticFiles(directory=STATIC_DIR), name="ui static")
    files = sorted(p.relative_to(STATIC_DIR).as_posix() for p in STATIC_DIR.rglob("*") if p.is_file())
    return ("/", "/dashboard", *(f"{STATIC_PREFIX}/{name}" for name in files))


def _page(name: str, kind: str) -> str:
    """A page's HTML, told which dashboard it belongs to (the router's shows its instances)."""
    return (STATIC_DIR / name).read_text(encoding="utf-8").replace('data-kind="server"', f'data-kind="{kind}"')
