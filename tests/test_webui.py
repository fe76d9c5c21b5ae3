"""The chat page (GET / for a browser) in a real browser: Playwright drives the system's
Chromium against the real server on the default model, served with an API key as a user would
put it on a network. The answers are the model's own; the page is the only client."""

import json
import re
import shutil
import time

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from tests.http_server import serving
from tinyllm import LLM
from tinyllm.entrypoints.cli import build_parser
from tinyllm.entrypoints.server.app import create_app

pytestmark = pytest.mark.slow
# An answer takes seconds on a busy 2-core machine; Playwright's checks wait up to this long.
expect.set_options(timeout=30_000)

KEY = "sk-webui-test"
KEY_ERROR = "missing or wrong API key"  # the server's 401 message (app.py)
QUESTION = "What is the capital of France?"
# `ran` is set only if the script in the text ran; a dialog opens only if the handler did.
ATTACK = "<img src=x onerror=alert(1)> <script>window.ran = 1</script>"


@pytest.mark.parametrize("ui", [True, False])
def test_get_root_is_the_page_for_browsers_and_ollama_for_clients(default_llm, ui):
    # First in the module, before its server takes the engine; no lifespan: these routes
    # never reach the engine.
    client = TestClient(create_app(default_llm, api_key=KEY, ui=ui))
    api_client = client.get("/", headers={"Authorization": f"Bearer {KEY}"})
    assert api_client.text == "Ollama is running"
    html = client.get("/", headers={"Accept": "text/html,*/*;q=0.8"})
    if not ui:
        assert html.status_code == 401  # Ollama's route, behind the key
        return
    assert html.status_code == 200 and "/ui/app.js" in html.text  # no key needed for the page
    csp = html.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert client.get("/ui/app.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/ui/nothing.js").status_code == 404


def test_no_ui_flag():
    parser = build_parser()
    assert parser.parse_args(["serve"]).ui is True
    assert parser.parse_args(["serve", "--no-ui"]).ui is False


@pytest.fixture(scope="module")
def base_url(default_llm):
    with serving(create_app(default_llm, api_key=KEY)) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    assert chromium, "the chat page's tests need the system's Chromium: apt-get install chromium"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium)
        yield b
        b.close()


@pytest.fixture
def browser_events():
    """What the page did besides drawing: the dialogs it opened, its uncaught errors."""
    return {"dialogs": [], "errors": []}


def open_page(browser, base_url, events, key: str | None = KEY, **context_args):
    """A fresh browser profile on the page; with `key`, one that already holds the API key
    (as after the user typed it once)."""
    storage = [{"name": "tinyllm.apiKey", "value": key}] if key else []
    context = browser.new_context(
        base_url=base_url,
        storage_state={"origins": [{"origin": base_url, "localStorage": storage}]},
        **context_args,
    )
    page = context.new_page()
    page.on("dialog", lambda d: (events["dialogs"].append(d.message), d.dismiss()))
    page.on("pageerror", lambda e: events["errors"].append(str(e)))
    page.goto("/")
    return page


@pytest.fixture
def page(browser, base_url, browser_events):
    page = open_page(browser, base_url, browser_events)
    expect(page.locator("#model")).not_to_be_empty()  # /v1/models answered with the key
    yield page
    page.context.close()
    assert browser_events["errors"] == []


def setting(page, field: str, value: str) -> None:
    """Types `value` into the settings' `field` (opening the folded settings)."""
    page.locator("#settings").evaluate("details => { details.open = true; }")
    page.fill(field, value)


def ask(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def server_metrics(base_url: str) -> dict[str, float]:
    """Every sample of /metrics, by name (and its labels' values, comma-joined, if any)."""
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    return {",".join([s.name, *s.labels.values()]): s.value for s in samples}


def test_answer_streams_in_with_its_numbers(page):
    ask(page, QUESTION)
    answer = page.locator(".message.assistant").last
    expect(answer.locator(".content")).to_contain_text("Paris")
    stats = answer.locator(".stats")
    expect(stats).to_contain_text("tokens/s")
    expect(stats).to_contain_text("first token")
    assert page.locator("#prompt").input_value() == ""  # Enter sent it
    # Regenerating sends the same prompt again: its blocks come from the prefix cache.
    answer.get_by_role("button", name="Regenerate").click()
    expect(page.locator(".message.assistant .stats")).to_contain_text("tokens/s")
    cached = page.locator(".message.assistant .stats").text_content()
    assert int(cached.split("·")[-1].split()[0]) > 0, cached
    assert page.locator(".message").count() == 2


def test_stop_ends_the_stream_and_frees_the_request(page, base_url, tmp_path):
    aborted = "tinyllm_request_success_total,abort"
    aborts = server_metrics(base_url).get(aborted, 0)
    setting(page, "#max-tokens", "400")
    ask(page, "Write a long story about a dragon who learns to bake bread.")
    content = page.locator(".message.assistant .content")
    # Streaming: text is on the page while the answer is still running (Stop shown).
    expect(content).to_have_text(re.compile(".{60}", re.S))
    expect(page.locator("#stop")).to_be_visible()
    shot = tmp_path / "chat-mid-answer.png"
    page.screenshot(path=shot)
    print(f"screenshot mid-answer: {shot}")
    page.click("#stop")
    expect(page.locator(".message.assistant .stats")).to_have_text("Stopped.")
    expect(page.locator("#send")).to_be_visible()
    stopped_at = content.text_content()
    deadline = time.monotonic() + 1
    while (m := server_metrics(base_url))["tinyllm_num_requests_running"] or m[
        "tinyllm_kv_blocks_used"
    ]:
        assert time.monotonic() < deadline, f"still running a second after Stop: {m}"
        time.sleep(0.05)
    assert m[aborted] == aborts + 1  # the server aborted it, not the answer ending
    assert content.text_content() == stopped_at and stopped_at  # the partial answer stays


def test_reload_keeps_the_conversation_and_new_chat_clears_it(page):
    setting(page, "#max-tokens", "8")
    ask(page, QUESTION)
    expect(page.locator(".message.assistant .stats")).to_contain_text("tokens/s")
    answer = page.locator(".message.assistant .content").text_content()
    page.reload()
    expect(page.locator(".message")).to_have_count(2)
    expect(page.locator(".message.user .content")).to_have_text(QUESTION)
    expect(page.locator(".message.assistant .content")).to_have_text(answer)
    expect(page.locator("#max-tokens")).to_have_value("8")  # the settings stay too
    page.click("#new-chat")
    expect(page.locator(".message")).to_have_count(0)
    page.reload()
    expect(page.locator("#model")).not_to_be_empty()
    expect(page.locator(".message")).to_have_count(0)


def test_edit_a_message_and_copy_the_answer(page):
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    ask(page, QUESTION)
    expect(page.locator(".message.assistant .stats")).to_contain_text("tokens/s")
    page.locator(".message.user").get_by_role("button", name="Edit").click()
    page.fill(".message.user textarea", "What is the capital of Germany?")
    page.locator(".message.user").get_by_role("button", name="Send").click()
    expect(page.locator(".message.assistant .stats")).to_contain_text("tokens/s")
    expect(page.locator(".message")).to_have_count(2)  # the old answer went with the old text
    answer = page.locator(".message.assistant .content")
    expect(answer).to_contain_text("Berlin")
    page.locator(".message.assistant").get_by_role("button", name="Copy").click()
    expect(page.locator(".message.assistant").get_by_role("button", name="Copied")).to_be_visible()
    assert page.evaluate("navigator.clipboard.readText()") == answer.text_content()


def test_api_key_is_asked_for_and_a_wrong_one_shows_the_401(browser, base_url, browser_events):
    page = open_page(browser, base_url, browser_events, key=None)
    expect(page.locator("#key-form")).to_be_visible()
    expect(page.locator("#key-message")).to_contain_text(KEY_ERROR)
    page.fill("#key", "sk-wrong")
    page.click("#key-form button")
    expect(page.locator("#key-message")).to_contain_text(
        f"The server refused this key: {KEY_ERROR}"
    )
    page.fill("#key", KEY)
    page.click("#key-form button")
    expect(page.locator("#key-form")).to_be_hidden()
    expect(page.locator("#model")).not_to_be_empty()
    page.reload()  # asked once: the browser keeps it
    expect(page.locator("#model")).not_to_be_empty()
    expect(page.locator("#key-form")).to_be_hidden()
    page.context.close()
    assert browser_events["errors"] == []


def test_html_in_a_message_or_an_answer_is_shown_as_text(page, browser_events):
    # The JSON-schema box makes the model's answer the string holding the markup.
    setting(page, "#schema", json.dumps({"enum": [ATTACK]}))
    # The user's message goes through the same renderer: markup and a code block in it.
    ask(page, f"Repeat this: {ATTACK}\n```html\n{ATTACK}\n```")
    answer = page.locator(".message.assistant .content")
    expect(page.locator(".message.assistant .stats")).to_contain_text("tokens/s")
    assert json.loads(answer.text_content()) == ATTACK  # the model's answer, as text
    expect(page.locator(".message.user p")).to_have_text(f"Repeat this: {ATTACK}")
    expect(page.locator(".message.user pre code")).to_have_text(ATTACK)
    assert page.locator("#messages img, #messages script").count() == 0
    page.wait_for_timeout(200)  # an onerror would have fired by now
    assert browser_events["dialogs"] == [] and page.evaluate("window.ran") is None


def test_page_fits_a_phone_and_shows_server_errors(browser, base_url, browser_events):
    page = open_page(browser, base_url, browser_events, viewport={"width": 375, "height": 700})
    expect(page.locator("#model")).not_to_be_empty()
    assert page.evaluate("document.documentElement.scrollWidth") <= 375
    send = page.locator("#send").bounding_box()
    assert send["x"] + send["width"] <= 375 and send["y"] + send["height"] <= 700
    ask(page, "word " * 3000)  # over the 2048-token context: the server's 400, on the page
    expect(page.locator(".message.assistant .error")).to_contain_text("2048")
    setting(page, "#schema", "{not json")  # refused before anything is sent
    ask(page, QUESTION)
    expect(page.locator(".message.assistant .error").last).to_contain_text("not JSON")
    page.context.close()
    assert browser_events["errors"] == []


def test_thinking_is_shown_folded_above_the_answer(browser, default_gguf_path, browser_events):
    # deepseek_r1: the answer starts inside the thinking; the default model never closes it,
    # so all it writes is thinking (reasoning_content), apart from the answer.
    thinker = LLM(str(default_gguf_path), reasoning_parser="deepseek_r1", max_model_len=256)
    with serving(create_app(thinker)) as url:
        page = open_page(browser, url, browser_events, key=None)
        ask(page, QUESTION)
        expect(page.locator(".message.assistant .stats")).to_contain_text("tokens/s")
        thinking = page.locator(".message.assistant details.reasoning")
        expect(thinking).not_to_have_attribute("open", "")
        expect(page.locator(".message.assistant .content")).to_be_empty()
        thinking.locator("summary").click()
        expect(thinking).to_contain_text("Paris")
        page.context.close()
    thinker.close()
    assert browser_events["errors"] == []
