"""The chat page (`/`) and the dashboard (`/dashboard`) in a real browser: headless Chromium (Debian's
/usr/bin/chromium, driven by Playwright; never a downloaded browser) against real servers. A tiny
vision model behind an API key answers the chat (streamed, stopped, with an image, with a forced
tool call; conversations kept across a reload, exported and imported) and feeds the dashboard; a
PD deployment (`serve --pd 1p1d`) with a LoRA adapter serves the router's pages; a router started
with --disable-ui has none. Screenshots at desktop and phone sizes go to test-artifacts/ui/."""

from __future__ import annotations

import base64
import io
import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from splitserve.entrypoints.ui import missing_vendor_files
from tests.helpers.models import make_peft_adapter
from tests.helpers.multimodal import random_image
from tests.helpers.pd import COMMON as PD_COMMON
from tests.helpers.server import RemoteServer, metric

pytestmark = pytest.mark.slow  # starts servers and a browser

CHROMIUM = os.environ.get("SPLITSERVE_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DESKTOP, PHONE = {"width": 1280, "height": 800}, {"width": 390, "height": 844}
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "ui"
KEY = "ui-test-key"
UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": UNIT}}]
ANSWERED = ".message.assistant:not(.streaming) .stats:not(:empty)"  # an answer that has ended
# marked, DOMPurify and uPlot, which `make setup` installs with npm: without them Markdown and charts are not tested.
NO_LIBRARIES = missing_vendor_files()
needs_libraries = pytest.mark.skipif(bool(NO_LIBRARIES), reason=f"the UI's npm libraries are missing: {NO_LIBRARIES}")


# --- the browser and the servers ------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (the test extra: pip install playwright)")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install chromium chromium-driver (.ci/run does)")
    with sync_playwright() as playwright:
        try:
            chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        except Exception as exc:  # a browser that cannot start here is a skip, with its reason
            pytest.skip(f"Chromium at {CHROMIUM} did not start: {exc}")
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def vision(browser, tiny_llava):
    """The tiny LLaVA behind an API key (started after the browser: no server when the tests skip)."""
    args = ["--enable-mm", "--dtype", "float32", "--max-model-len", "512", "--disable-log-requests"]
    with RemoteServer(tiny_llava, *args, "--api-key", KEY) as server:
        yield server


@pytest.fixture(scope="module")
def pd(browser, tiny_chat_model, tmp_path_factory):
    """serve --pd 1p1d with a LoRA adapter "sql": the router's pages, and a second model to pick."""
    adapter = make_peft_adapter(tiny_chat_model, str(tmp_path_factory.mktemp("ui_lora")), ["q_proj", "v_proj"], r=4)
    lora = ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "8", "--lora-modules", f"sql={adapter}"]
    with RemoteServer(tiny_chat_model, *PD_COMMON, *lora, "--pd", "1p1d") as router:
        yield router


class Pages:
    """Pages, each in a fresh browser context (its own storage), whose uncaught errors fail the test."""

    def __init__(self, browser):
        self.browser, self.contexts, self.errors = browser, [], []

    def open(self, url: str, key: str | None = KEY, viewport=DESKTOP, context=None):
        if context is None:
            context = self.browser.new_context(viewport=viewport, accept_downloads=True)
            self.contexts.append(context)
            if key:  # as if typed into the prompt once (the prompt itself: test_the_page_asks_for_the_api_key)
                context.add_init_script(f"localStorage.setItem('splitserve.apiKey', {json.dumps(key)})")
        page = context.new_page()
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        page.goto(url)
        return page


@pytest.fixture
def pages(browser):
    opened = Pages(browser)
    yield opened
    for context in opened.contexts:
        context.close()
    assert not opened.errors, opened.errors


def until(predicate, timeout: float = 30.0, what: str = "the condition"):
    """Poll `predicate()` (page.evaluate is not held by the pages' CSP, as wait_for_function is)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def models_listed(page) -> list[str]:
    page.wait_for_selector("#model option:not([value=''])", state="attached")
    return page.eval_on_selector_all("#model option", "options => options.map(o => o.value)")


def ask(page, text: str, max_tokens: int = 12) -> None:
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#input", text)
    page.keyboard.press("Enter")


def last_answer(page) -> dict:
    page.wait_for_selector(ANSWERED)
    answer = page.locator(".message.assistant").last
    return {"text": answer.locator(".content").text_content(), "stats": answer.locator(".stats").text_content()}


def screenshot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def card(page, name: str) -> str:
    return page.text_content(f'.card[data-metric="{name}"] .value')


def charts(page, count: int) -> None:
    """The dashboard's uPlot charts, all drawn at once when the library has loaded (or its note without it)."""
    page.wait_for_selector(".status.ok")
    if NO_LIBRARIES:
        assert "No charts" in page.text_content("#notes")
    else:
        page.wait_for_selector(".chart canvas")
        assert page.locator(".chart canvas").count() == count


def number(text: str) -> float:
    return 0.0 if text == "—" else float(text)


# --- the chat page ----------------------------------------------------------------------------------
def test_an_answer_streams_in_as_markdown_with_its_numbers(vision, pages):
    pages.open(vision.url + "/dashboard")  # the browser's first page pays for its own start
    page = pages.open(vision.url + "/")
    fcp = page.evaluate(
        """() => new Promise(resolve => new PerformanceObserver(list => resolve(list.getEntries()
            .find(e => e.name === 'first-contentful-paint').startTime)).observe({type: 'paint', buffered: true}))"""
    )
    print(f"first contentful paint of /: {fcp:.0f} ms")
    assert fcp < 1000  # 100-160 ms on this 2-core machine; generous for a loaded one
    served = httpx.get(f"{vision.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    assert models_listed(page) == [model["id"] for model in served]
    page.evaluate(  # every change of the answer's text, with its time
        """() => { window.growth = []; new MutationObserver(() => { const a = document.querySelector(
            '.message.assistant .content'); if (a) window.growth.push([performance.now(), a.textContent.length]);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true}); }"""
    )
    ask(page, "Tell me a story", max_tokens=120)
    answer = last_answer(page)
    growth = page.evaluate("window.growth")
    assert len({n for _, n in growth if n > 0}) >= 3, growth  # shown piece by piece, not at the end
    assert "TTFT" in answer["stats"] and "tok/s" in answer["stats"] and "120 tokens" in answer["stats"], answer
    lag = int(page.get_attribute(".message.assistant", "data-render-lag-ms"))
    print(f"longest wait between a streamed chunk and its paint: {lag} ms")
    assert lag < 250  # one frame (~17 ms) when idle; generous for a loaded machine
    screenshot(page, "chat-desktop")
    phone = pages.open(vision.url + "/", viewport=PHONE)
    ask(phone, "Hi", max_tokens=24)
    last_answer(phone)
    assert phone.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]  # no sideways scrolling
    assert phone.locator("#sidebar").bounding_box()["x"] < 0 and phone.is_visible("#send")
    screenshot(phone, "chat-phone")
    phone.click("#toggle-sidebar")
    until(lambda: phone.locator("#sidebar").bounding_box()["x"] >= 0, 5, "the sidebar to slide in")
    screenshot(phone, "chat-phone-sidebar")


@needs_libraries
def test_markdown_is_sanitised_and_reasoning_and_tools_are_shown_apart(vision, pages):
    """A canned stream (the tiny model writes neither Markdown nor reasoning): rendered, sanitised."""
    page = pages.open(vision.url + "/")
    models_listed(page)
    markdown = '# Title\n\nSome **bold**.\n\n```python\nprint(1)\n```\n<img src=x onerror="window.pwned=1">'
    markdown += "<script>window.pwned=2</script>[link](javascript:window.pwned=3)"
    deltas = [
        {"role": "assistant", "reasoning_content": "Let me think."},
        {"content": markdown},
        {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "get_weather", "arguments": '{"unit"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ': "c"}'}}]},
    ]
    events = [{"choices": [{"index": 0, "delta": d}]} for d in deltas]
    events.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}})
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    sent = []

    def fulfil(route):
        sent.append(json.loads(route.request.post_data))
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)

    page.route("**/v1/chat/completions", fulfil)
    ask(page, "Format something")
    assert "7 tokens" in last_answer(page)["stats"]
    assert sent[0]["stream"] and sent[0]["stream_options"] == {"include_usage": True}
    answer = page.locator(".message.assistant").last
    assert answer.locator(".content h1").text_content() == "Title"
    assert answer.locator(".content strong").text_content() == "bold"
    assert answer.locator(".content pre code.language-python").text_content().strip() == "print(1)"
    assert answer.locator(".content script, .content [onerror]").count() == 0
    assert answer.locator(".content a[href^='javascript']").count() == 0
    assert page.evaluate("window.pwned") is None
    reasoning = answer.locator("details.reasoning")
    assert reasoning.is_visible() and not reasoning.get_attribute("open")  # collapsed, apart from the answer
    assert reasoning.text_content() == "ReasoningLet me think."
    assert answer.locator("details.tool-call summary").text_content() == "Tool call: get_weather"
    assert json.loads(answer.locator("details.tool-call pre").text_content()) == {"unit": "c"}


def test_stop_aborts_the_request_on_the_server(vision, pages):
    page = pages.open(vision.url + "/")
    models_listed(page)
    finished = metric(vision, "splitserve:request_success_total")
    ask(page, "Write at length", max_tokens=480)
    until(lambda: len(page.text_content(".message.assistant .content")) > 40, what="the answer to begin")
    page.keyboard.press("Escape")
    answer = last_answer(page)
    assert "stopped" in answer["stats"], answer
    assert page.is_visible("#send") and not page.is_visible("#stop")
    # The closed connection aborted the request: nothing runs, and it never finished (480 tokens take ~2 s).
    until(lambda: metric(vision, "splitserve:num_requests_running") == 0, 10, "the server to abort the request")
    time.sleep(2.5)
    assert metric(vision, "splitserve:request_success_total") == finished


def test_an_image_goes_as_a_data_url(vision, pages):
    page = pages.open(vision.url + "/")
    models_listed(page)
    png = io.BytesIO()
    random_image(3).save(png, format="PNG")
    page.set_input_files("#attach", files=[{"name": "cat.png", "mimeType": "image/png", "buffer": png.getvalue()}])
    page.wait_for_selector("#attachments img")
    with page.expect_request("**/v1/chat/completions") as request:
        ask(page, "What is in this picture?", max_tokens=8)
    parts = request.value.post_data_json["messages"][-1]["content"]
    assert parts[0]["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    assert parts[1] == {"type": "text", "text": "What is in this picture?"}
    answer = last_answer(page)
    assert "error" not in answer["stats"] and answer["text"], answer
    assert page.get_attribute(".message.user img", "src").startswith("data:image/png;base64,")


def test_a_forced_tool_call_is_shown(vision, pages):
    page = pages.open(vision.url + "/")
    models_listed(page)
    page.fill("#tools", json.dumps(TOOLS))
    page.select_option("#tool_choice", "required")
    ask(page, "What is the weather?", max_tokens=64)
    answer = last_answer(page)
    assert "error" not in answer["stats"], answer
    assert page.text_content("details.tool-call summary") == "Tool call: get_weather"
    assert json.loads(page.text_content("details.tool-call pre"))["unit"] in ("c", "f")


def test_conversations_survive_a_reload_and_travel_as_json(vision, pages, tmp_path):
    page = pages.open(vision.url + "/")
    models_listed(page)
    page.fill("#system", "You are terse.")
    for name, value in (("#temperature", "0.5"), ("#top_p", "0.9"), ("#seed", "7")):
        page.fill(name, value)
    page.check("#json")
    with page.expect_request("**/v1/chat/completions") as request:
        ask(page, "First question")
    sent = request.value.post_data_json
    assert sent["messages"][0] == {"role": "system", "content": "You are terse."}
    assert (sent["temperature"], sent["top_p"], sent["seed"], sent["max_tokens"]) == (0.5, 0.9, 7, 12)
    assert sent["response_format"] == {"type": "json_object"}
    first = last_answer(page)["text"]
    page.click("#new-chat")
    ask(page, "Second question")
    last_answer(page)
    page.reload()
    titles = page.locator("#conversations .title").all_text_contents()
    assert titles == ["Second question", "First question"]
    page.click("#conversations li:nth-child(2) .title")
    assert page.text_content(".message.user .text") == "First question"
    assert page.text_content(".message.assistant .content") == first
    assert page.input_value("#system") == "You are terse."
    with page.expect_download() as download:
        page.click("#export")
    saved = tmp_path / "chats.json"
    download.value.save_as(saved)
    assert [c["title"] for c in json.loads(saved.read_text())["conversations"]] == titles
    other = pages.open(vision.url + "/")  # another browser: nothing stored, until the import
    assert other.locator("#conversations li").count() == 0
    other.set_input_files("#import", str(saved))
    other.wait_for_selector("#conversations li:nth-child(2)")
    assert other.locator("#conversations .title").all_text_contents() == titles


def test_the_page_asks_for_the_api_key(vision, pages):
    for path in ("/", "/dashboard", "/ui/chat.js", "/ui/style.css"):  # the pages hold no secret
        assert httpx.get(vision.url + path).status_code == 200, path
    assert httpx.get(vision.url + "/v1/models").status_code == 401
    page = pages.open(vision.url + "/", key=None)
    page.wait_for_selector("dialog.key-dialog[open]")
    assert "API key" in page.text_content("dialog.key-dialog .reason")
    page.fill("dialog.key-dialog input[name=key]", "wrong")
    with page.expect_response(lambda r: r.url.endswith("/v1/models") and r.status == 401):
        page.keyboard.press("Enter")
    page.wait_for_selector("dialog.key-dialog[open]")  # asked again
    page.fill("dialog.key-dialog input[name=key]", KEY)
    page.uncheck("dialog.key-dialog input[name=remember]")
    page.keyboard.press("Enter")
    assert models_listed(page)
    assert page.evaluate(
        "[sessionStorage.getItem('splitserve.apiKey'), localStorage.getItem('splitserve.apiKey')]"
    ) == [
        KEY,
        None,
    ]
    with page.expect_request("**/v1/chat/completions") as request:
        ask(page, "Hello")
    assert request.value.headers["authorization"] == f"Bearer {KEY}"
    assert "error" not in last_answer(page)["stats"]


# --- the dashboard ----------------------------------------------------------------------------------
def test_the_dashboard_moves_while_requests_run(vision, pages):
    page = pages.open(vision.url + "/dashboard")
    charts(page, 5)  # requests, tokens/s, TTFT, inter-token latency, KV cache
    before = int(card(page, "finished"))

    stop, done = threading.Event(), []

    def load():  # streamed requests one after the other, until the dashboard has shown them
        body = {"messages": [{"role": "user", "content": "Go on"}], "max_tokens": 40, "stream": True}
        while not stop.is_set():
            url, headers = f"{vision.url}/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}
            with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
                done.append(sum(1 for line in r.iter_lines() if line == "data: [DONE]"))

    worker = threading.Thread(target=load)
    worker.start()
    try:
        seen = until(lambda: card(page, "running") == "1" and number(card(page, "tokens_per_s")) > 0, 60, "load")
    finally:
        stop.set()
        worker.join()
    assert seen and sum(done) >= 1
    until(lambda: int(card(page, "finished")) == before + sum(done), 10, "the finished requests to be counted")
    assert card(page, "ttft").count("ms") + card(page, "ttft").count(" s") == 3  # p50 / p90 / p99
    # The recent requests' table: the last finished first, each with its tokens and timings.
    row = until(lambda: page.locator("#recent tbody tr").count() >= sum(done) and first_row(page), 10, "recent")
    assert row[2] == "length" and row[5] == "40" and row[7].endswith("ms") and row[8].endswith("ms"), row
    screenshot(page, "dashboard-desktop")
    phone = pages.open(vision.url + "/dashboard", viewport=PHONE)
    charts(phone, 5)
    time.sleep(2)  # a few points on the charts
    assert phone.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    screenshot(phone, "dashboard-phone")


def first_row(page) -> list[str]:
    return page.locator("#recent tbody tr").first.evaluate("r => [...r.cells].map(c => c.textContent)")


def test_the_dashboard_reads_vllm_names_and_expert_load(vision, pages):
    """--metrics-prefix vllm's names (the server's /metrics renamed on the way), and an expert-load metric."""
    experts = "".join(f'vllm:moe_expert_load{{expert="{i}"}} {i + 1}.0\n' for i in range(8))
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    httpx.post(f"{vision.url}/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)

    def renamed(route):
        text = route.fetch().text().replace("splitserve:", "vllm:")
        route.fulfill(status=200, headers={"Content-Type": "text/plain"}, body=text + experts)

    context = pages.browser.new_context(viewport=DESKTOP)
    pages.contexts.append(context)
    context.route("**/metrics", renamed)
    page = pages.open(vision.url + "/dashboard", context=context)
    page.wait_for_selector(".status.ok")
    assert int(card(page, "finished")) == metric(vision, "splitserve:request_success_total") > 0
    assert card(page, "ttft").count("—") == 0
    assert page.locator("#experts .bar").count() == 8 and page.is_visible("#experts")


# --- the PD router, and --disable-ui --------------------------------------------------------------------
def test_the_routers_pages(pd, pages):
    page = pages.open(pd.url + "/")
    models = models_listed(page)
    assert "sql" in models and "LoRA of" in page.text_content("#model option[value=sql]")
    page.select_option("#model", "sql")
    with page.expect_request("**/v1/chat/completions") as request:
        ask(page, "Hello through prefill and decode")
    assert request.value.post_data_json["model"] == "sql"
    assert "error" not in last_answer(page)["stats"]
    page.reload()  # the conversation keeps its model
    assert "sql" in models_listed(page) and page.input_value("#model") == "sql"
    dashboard = pages.open(pd.url + "/dashboard")
    dashboard.wait_for_selector("#instances tbody tr:nth-child(2)")
    rows = [
        r.split("\t")
        for r in dashboard.locator("#instances tbody tr").evaluate_all(
            "rows => rows.map(r => [...r.cells].map(c => c.textContent).join('\\t'))"
        )
    ]
    assert sorted((r[1], r[2]) for r in rows) == [("decode", "up"), ("prefill", "up")]
    kv_cells = "rows => rows.map(r => r.cells[6].textContent)"  # each instance's KV transfer rate
    until(
        lambda: all(t.endswith("MB/s") for t in dashboard.locator("#instances tbody tr").evaluate_all(kv_cells)),
        15,
        "the instances' KV transfer rates",
    )
    assert card(dashboard, "instances_up") == "2 / 2"
    until(lambda: "—" not in card(dashboard, "latency"), 10, "the chat's latency")  # p50 / p90 / p99
    assert card(dashboard, "failures") == "0"
    charts(dashboard, 4)
    screenshot(dashboard, "router-dashboard-desktop")
    phone = pages.open(pd.url + "/dashboard", viewport=PHONE)
    phone.wait_for_selector("#instances tbody tr")
    screenshot(phone, "router-dashboard-phone")


def test_disable_ui_leaves_the_usual_404(vision):
    """A router (quick to start: no model) over the vision server, with --disable-ui."""
    args = ["router", "--mixed", vision.url, "--instance-api-key", KEY, "--disable-ui"]
    with RemoteServer(None, *args) as router:
        for path in ("/", "/dashboard", "/ui/chat.js"):
            r = httpx.get(router.url + path)
            assert r.status_code == 404, path
        assert httpx.get(router.url + "/v1/models").status_code == 200  # the API is still there
