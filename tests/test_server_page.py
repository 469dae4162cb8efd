"""The web chat page (``GET /`` of ``qinfer serve``) driven in a real headless Chromium against a real server of a
tiny chat model: streamed replies with their stats, a second turn that carries the first, Stop ending the request on
the server, the API key and errors shown in the page, and nothing loaded from anywhere but the server.

Debian's ``chromium`` and ``chromium-driver`` packages (CI installs them); without them the tests skip.
"""

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file
from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait
from tokenizers import Tokenizer

from tests.serving import serve, tiny_chat_model

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
KEY = "page-test-key"
CONTEXT = 4096
WAIT = 60  # seconds a step may take before the test fails (a busy 2-core machine runs the browser and the server)

# Wraps the page's fetch to keep each request's JSON body and headers, for the tests to read as window.sent.
RECORD_REQUESTS = """
window.sent = [];
const fetch0 = window.fetch;
window.fetch = (url, init) => {
  window.sent.push({url, headers: init.headers, body: JSON.parse(init.body)});
  return fetch0(url, init);
};
"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not CHROMIUM.exists() or not CHROMEDRIVER.exists():
        pytest.skip(f"needs Chromium and its driver ({CHROMIUM}, {CHROMEDRIVER}: Debian's chromium and "
                    "chromium-driver packages)")
    options = Options()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # The driver's path given: selenium never looks for (or downloads) one.
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        # A phone's screen (headless Chromium keeps a window at least 500 px wide): the page must fit its width.
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": 390, "height": 844, "deviceScaleFactor": 1, "mobile": True})
        yield driver
    finally:
        driver.quit()


def text_model(folder: Path) -> Path:
    """The tiny chat model, changed so that a greedy reply streams text, token by token, until its max tokens.

    Its context is widened from 256 so that a reply can run for seconds (the stop test presses Stop mid-reply); the
    weights need no change for that (RoPE has no position table). And the embedding rows, tied to the output layer,
    of the tokens that alone decode to no text (<s>, </s>) or to part of a character are zeroed: their logit is then
    0, below the largest of the others' (random, of either sign), so greedy decoding never picks one. Otherwise the
    reply ends at a random </s>, or the server holds back a run of incomplete characters until the reply ends.
    """
    tiny_chat_model(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    no_text = [i for i in range(tokenizer.get_vocab_size())
               if not tokenizer.decode([i]) or "\ufffd" in tokenizer.decode([i])]
    weights = load_file(folder / "model.safetensors")
    weights["model.embed_tokens.weight"][no_text] = 0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(text_model(tmp_path_factory.mktemp("chat-model")), "--dtype", "fp32", "--api-key", KEY) as s:
        yield s


@pytest.fixture
def page(browser, server):
    """The chat page freshly loaded, with no API key stored, recording the requests it sends."""
    browser.get_log("browser")  # reading the log empties it: what the test reads later is its own
    browser.get(server.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.refresh()
    browser.execute_script(RECORD_REQUESTS)
    return browser


def get(server, path: str) -> bytes:
    request = urllib.request.Request(server.url + path, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=WAIT) as response:
        return response.read()


def metric(server, name: str, **labels) -> float:
    """A sample of the server's /metrics (0 if it has none yet, as a counter without a label value seen)."""
    for family in text_string_to_metric_families(get(server, "/metrics").decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def wait(driver, condition, what: str):
    return WebDriverWait(driver, WAIT).until(condition, f"waited {WAIT} s for {what}")


def setting(driver, field: str, value) -> None:
    """Type into a settings field, as a user would: open the settings, replace the field's text."""
    panel = driver.find_element(By.ID, "settings")
    if not panel.get_property("open"):
        panel.find_element(By.TAG_NAME, "summary").click()
    element = driver.find_element(By.ID, field)
    element.clear()
    element.send_keys(str(value))


def chat_settings(driver, max_tokens: int) -> None:
    """The API key, greedy decoding (the replies of :func:`text_model` are then text), and the max tokens."""
    setting(driver, "api-key", KEY)
    setting(driver, "temperature", 0)
    setting(driver, "max-tokens", max_tokens)


def say(driver, text: str, click: bool = False) -> None:
    """Type a message and send it with Enter (or the Send button)."""
    box = driver.find_element(By.ID, "input")
    box.send_keys(text)
    if click:
        driver.find_element(By.ID, "send").click()
    else:
        box.send_keys(Keys.ENTER)


def replies(driver) -> list:
    return driver.find_elements(By.CSS_SELECTOR, "#messages .assistant")


def text(element) -> str:
    return element.find_element(By.CLASS_NAME, "text").get_property("textContent")


def stats(element) -> str:
    return element.find_element(By.CLASS_NAME, "stats").get_property("textContent")


def wait_replies(driver, count: int) -> list:
    """The page's replies once ``count`` of them have ended (stats or an error under each) and Send is back."""
    wait(driver, lambda d: len(replies(d)) == count and all(stats(r) for r in replies(d))
         and d.find_element(By.ID, "send").is_enabled(), f"{count} finished replies")
    return replies(driver)


def sent(driver) -> list[dict]:
    return driver.execute_script("return window.sent")


def console_errors(driver, network_too: bool = True) -> list[dict]:
    """The page's console errors since the log was last read; ``network_too=False`` leaves out the browser's own
    report of an HTTP error response (a test that asks for one)."""
    return [e for e in driver.get_log("browser")
            if e["level"] == "SEVERE" and (network_too or e.get("source") != "network")]


def test_streamed_reply_stats_and_second_turn(page, server):
    model = json.loads(get(server, "/v1/models"))["data"][0]["id"]
    assert page.find_element(By.ID, "model").text == model
    assert page.find_element(By.ID, "temperature").get_property("value") == "0.7"
    assert page.find_element(By.ID, "max-tokens").get_property("value") == "256"
    chat_settings(page, 32)

    prompt_tokens = metric(server, "qinfer_prompt_tokens_total")
    say(page, "hello")
    [first] = wait_replies(page, 1)
    assert page.find_element(By.ID, "input").get_property("value") == ""
    answer = text(first)
    assert answer
    assert re.search(r"^32 tokens · \d+\.\d tok/s · TTFT \d+ ms", stats(first)), stats(first)
    first_prompt = metric(server, "qinfer_prompt_tokens_total") - prompt_tokens

    say(page, "hello", click=True)
    second = wait_replies(page, 2)[1]
    assert text(second) and "tok/s" in stats(second) and "TTFT" in stats(second)
    second_prompt = metric(server, "qinfer_prompt_tokens_total") - prompt_tokens - first_prompt

    bodies = [r["body"] for r in sent(page)]
    assert bodies[0] == {"model": model, "messages": [{"role": "user", "content": "hello"}], "temperature": 0,
                         "max_tokens": 32, "stream": True, "stream_options": {"include_usage": True}}
    assert bodies[1]["messages"] == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": answer},
                                     {"role": "user", "content": "hello"}]
    # The server saw it too: the same message again, after the first turn and its reply, is over twice the prompt.
    assert second_prompt > 2 * first_prompt > 0
    assert page.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    assert console_errors(page) == []


def test_stop_ends_the_request_on_the_server(page, server):
    chat_settings(page, CONTEXT - 100)  # seconds of reply (greedy never stops early), unless stopped
    aborted = metric(server, "qinfer_requests_total", finish_reason="abort")
    generated = metric(server, "qinfer_generation_tokens_total")
    stop = page.find_element(By.ID, "stop")
    assert not stop.is_enabled()

    say(page, "tell me everything")
    wait(page, lambda d: stop.is_enabled() and len(replies(d)) == 1 and text(replies(d)[0]),
         "the reply to begin streaming")
    stop.click()
    [reply] = wait_replies(page, 1)
    assert "stopped" in reply.get_attribute("class").split()
    assert stats(reply).startswith("stopped")
    partial = text(reply)
    assert partial
    assert not stop.is_enabled()

    # The server ended the request (finish reason "abort") and freed its KV-cache blocks.
    deadline = time.monotonic() + WAIT
    while metric(server, "qinfer_requests_total", finish_reason="abort") == aborted and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server, "qinfer_requests_total", finish_reason="abort") == aborted + 1
    assert metric(server, "qinfer_generation_tokens_total") - generated < CONTEXT - 100
    assert metric(server, "qinfer_kv_blocks_used") == 0
    assert metric(server, "qinfer_requests_running") == 0

    # The stopped part stays in the conversation.
    setting(page, "max-tokens", 4)
    say(page, "go on")
    wait_replies(page, 2)
    assert sent(page)[1]["body"]["messages"] == [{"role": "user", "content": "tell me everything"},
                                                 {"role": "assistant", "content": partial},
                                                 {"role": "user", "content": "go on"}]
    assert console_errors(page, network_too=False) == []


def test_api_key_and_errors_are_shown_in_the_page(page, server):
    say(page, "hello")  # no key yet
    [reply] = wait_replies(page, 1)
    error = reply.find_element(By.CLASS_NAME, "stats")
    assert "error" in error.get_attribute("class").split()
    assert error.text.startswith("no API key")  # the 401 body's error.message
    assert page.find_element(By.ID, "settings").get_property("open")  # open where the key goes
    with pytest.raises(NoAlertPresentException):
        page.switch_to.alert.text
    # The turn was taken back: marked, its text offered again, not sent with the next message.
    assert "failed" in page.find_element(By.CSS_SELECTOR, "#messages .user").get_attribute("class").split()
    assert page.find_element(By.ID, "input").get_property("value") == "hello"

    setting(page, "api-key", KEY)
    page.refresh()  # the key is kept in the browser
    page.execute_script(RECORD_REQUESTS)
    assert page.find_element(By.ID, "api-key").get_property("value") == KEY
    setting(page, "temperature", 0)
    setting(page, "max-tokens", CONTEXT + 1)
    page.find_element(By.ID, "input").clear()
    say(page, "hello")
    [reply] = wait_replies(page, 1)
    assert "exceeds the model's context of 4096 tokens" in stats(reply)  # a 400 body's error.message

    page.set_network_conditions(offline=True, latency=0, download_throughput=-1, upload_throughput=-1)
    try:
        page.find_element(By.ID, "input").clear()
        say(page, "hello")
        reply = wait_replies(page, 2)[1]
    finally:
        page.delete_network_conditions()
    assert stats(reply).startswith("Network error")

    setting(page, "max-tokens", 4)
    page.find_element(By.ID, "input").clear()
    say(page, "hello")
    reply = wait_replies(page, 3)[2]
    assert "tok/s" in stats(reply)
    request = sent(page)[-1]
    assert request["headers"]["Authorization"] == f"Bearer {KEY}"
    assert request["body"]["messages"] == [{"role": "user", "content": "hello"}]
    assert console_errors(page, network_too=False) == []


def test_system_prompt_and_new_chat(page, server):
    chat_settings(page, 4)
    setting(page, "system", "Answer briefly.")
    say(page, "<b>hello</b>")
    wait_replies(page, 1)
    shown = page.find_element(By.CSS_SELECTOR, "#messages .user .text")
    assert shown.get_property("textContent") == "<b>hello</b>"  # text, not HTML
    assert shown.find_elements(By.XPATH, "./*") == []
    page.find_element(By.ID, "new-chat").click()
    assert page.find_elements(By.CSS_SELECTOR, "#messages > *") == []
    say(page, "again")
    wait_replies(page, 1)
    system = {"role": "system", "content": "Answer briefly."}
    assert [r["body"]["messages"] for r in sent(page)] == [[system, {"role": "user", "content": "<b>hello</b>"}],
                                                           [system, {"role": "user", "content": "again"}]]
    assert console_errors(page) == []


def test_page_loads_nothing_from_elsewhere(page, server):
    html = get(server, "/").decode()
    assert "{{MODEL}}" not in html
    assert not re.search(r"https?:|//[\w.-]+\.\w|@import|url\(", html)  # no address of anything anywhere
    assert re.findall(r"""\b(?:src|href)\s*=\s*["']?([^"'\s>]*)""", html) == ["data:,"]  # the empty icon only

    chat_settings(page, 4)
    say(page, "hello")
    wait_replies(page, 1)
    resources = page.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert resources and all(r.startswith(server.url + "/") for r in resources), resources
    assert console_errors(page) == []
