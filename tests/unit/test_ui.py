"""The chat page and the dashboard (splitserve/entrypoints/ui), without a browser: the routes of
`splitserve serve` and of the PD router exist and answer HTML without the API key, stay out of the
OpenAPI document (which is the same with and without them), and are gone with --disable-ui; missing
third-party files cost one warning, not the page. tests/e2e/test_ui.py drives the pages in Chromium."""

from __future__ import annotations

import logging
from pathlib import Path
from unittest.mock import MagicMock

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from splitserve.entrypoints import ui
from splitserve.entrypoints.openai.app import build_app
from splitserve.entrypoints.openai.args import ServerArgs, make_arg_parser, split_args
from splitserve.entrypoints.router import RouterConfig, build_router_app
from splitserve.entrypoints.router.config import add_arguments, config_from_args

ROOT = Path(__file__).resolve().parents[2]
PAGES = {"/": "ui/chat.js", "/dashboard": "ui/dashboard.js"}
_apps = iter(range(1000))  # each server app registers its metrics under a prefix of its own


def _server_app(**server_args) -> FastAPI:
    """build_app over a stand-in engine (the routes are what is tested, no request reaches it)."""
    config = MagicMock()
    config.model_config.served_model_name = "m"
    config.model_config.vocab_size = 100
    config.model_config.max_model_len = 64
    config.model_config.sampling_defaults = {}
    config.kv_transfer_config.pd_role = "mixed"
    args = ServerArgs(metrics_prefix=f"ui_test_{next(_apps)}", **server_args)
    return build_app(MagicMock(), config, args)


def _router_app(**config) -> FastAPI:
    return build_router_app(
        RouterConfig(prefill_urls=["http://127.0.0.1:1"], decode_urls=["http://127.0.0.1:2"], **config)
    )


@pytest.mark.parametrize("make, kind", [(_server_app, "server"), (_router_app, "router")])
def test_the_pages_are_served_without_a_key_and_out_of_the_schema(make, kind):
    client = TestClient(make(api_key="secret"))
    for path, script in PAGES.items():
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), path
        assert script in r.text and f'data-kind="{kind}"' in r.text
        assert "script-src 'self'" in r.headers["content-security-policy"]
        assert client.get(f"/{script}").status_code == 200
    assert client.get("/ui/style.css").headers["content-type"].startswith("text/css")
    assert client.get("/v1/models").status_code == 401  # the API still needs the key
    paths = client.get("/openapi.json", headers={"Authorization": "Bearer secret"}).json()["paths"]
    assert not [p for p in paths if p in PAGES or p.startswith("/ui") or p == "/router/instances"]


@pytest.mark.parametrize("make", [_server_app, _router_app])
def test_disable_ui_leaves_the_usual_404_and_the_same_schema(make):
    with_ui, without = make(), make(disable_ui=True)
    client = TestClient(without)
    for path in (*PAGES, "/ui/chat.js"):
        assert client.get(path).status_code == 404, path
    assert without.openapi() == with_ui.openapi()


def test_the_flag_parses_for_serve_serve_pd_and_the_router():
    _, server_args = split_args(make_arg_parser().parse_args(["--disable-ui"]))
    assert server_args.disable_ui
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--mixed", "http://h:1", "--disable-ui"])).disable_ui


def test_the_router_lists_its_instances():
    client = TestClient(_router_app())
    body = client.get("/router/instances").json()
    assert body["roles"] == ["prefill", "decode"]
    assert [(i["url"], i["role"], i["healthy"]) for i in body["instances"]] == [
        ("http://127.0.0.1:1", "prefill", True),
        ("http://127.0.0.1:2", "decode", True),
    ]
    secured = TestClient(_router_app(api_key="secret"))
    assert secured.get("/router/instances").status_code == 401  # instance URLs are not for everyone


def test_missing_libraries_cost_a_warning_not_the_page(tmp_path, monkeypatch, caplog):
    for name in ("chat.html", "dashboard.html"):
        (tmp_path / name).write_text((ui.STATIC_DIR / name).read_text())
    monkeypatch.setattr(ui, "STATIC_DIR", tmp_path)
    monkeypatch.setattr(ui, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="splitserve.ui"):
        for _ in range(2):
            app = FastAPI()
            ui.add_ui_routes(app)
            assert TestClient(app).get("/").status_code == 200
    assert sorted(ui.missing_vendor_files()) == sorted(ui.VENDOR_FILES)
    warnings = [r for r in caplog.records if "make setup" in r.getMessage()]
    assert len(warnings) == 1 and "marked.js" in warnings[0].getMessage()


def test_set_up_installs_every_library_the_pages_load():
    """The Makefile copies each file of VENDOR_FILES; the pages ask for no other; npm's lock is committed."""
    makefile = (ROOT / "Makefile").read_text()
    scripts = "".join((ui.STATIC_DIR / name).read_text() for name in ("chat.js", "dashboard.js"))
    for name in ui.VENDOR_FILES:
        assert f"$(UI_VENDOR)/{name}" in makefile
        assert f'"{name}"' in scripts or f"/vendor/{name}" in scripts, name
    assert "npm ci --prefix ui" in makefile and (ROOT / "ui" / "package-lock.json").is_file()


def test_the_page_code_stays_small():
    own = [p for p in ui.STATIC_DIR.iterdir() if p.is_file()]
    assert sum(p.read_text().count("\n") for p in own) < 1500


def test_recent_requests_keep_the_last_ones_with_their_timings():
    from types import SimpleNamespace

    from splitserve.entrypoints.openai.recent_requests import RecentRequests
    from splitserve.outputs import RequestMetrics

    recent = RecentRequests(size=3)
    for i in range(5):
        metrics = RequestMetrics(100.0, first_scheduled_time=100.5, first_token_time=101.0, finished_time=103.0)
        output = SimpleNamespace(request_id=f"r{i}", prompt_token_ids=[1] * 7, num_cached_tokens=4, metrics=metrics)
        recent.add(output, 9, ["length"])
    answer = recent.answer()
    assert [r.request_id for r in answer.data] == ["r4", "r3", "r2"]  # the last three, most recent first
    r = answer.data[0]
    assert (r.prompt_tokens, r.cached_tokens, r.generated_tokens, r.finish_reason) == (7, 4, 9, "length")
    assert (r.queue_s, r.ttft_s, r.e2e_s, r.tokens_per_s) == (0.5, 1.0, 3.0, 4.0)
