"""The web page at / in a real browser: Debian's chromium, headless, driven by selenium through
chromium-driver (both installed by scripts/setup.sh; nothing is downloaded here). The page loads
without console errors, a question typed in streams its answer, a repeated question shows cached
tokens in the answer and a hit in the cache pane, Stop ends an answer, a server with --api-key
gets its key through the page's prompt, and --no-webui takes / away. The files served are the
sources in server/web/ byte for byte, with their Content-Type, CSP and ETag.

A screenshot of the page goes to <the binary's directory>/artifacts/webui.png (build/artifacts/
for make test, build-asan/artifacts/ for make test-asan): CI keeps it, and README shows a copy."""
import hashlib
import os
import shutil

import pytest
import requests

from conftest import BIN, ROOT, SLOW, KvServer

WEB = os.path.join(ROOT, "server", "web")
ARTIFACT = os.path.join(os.path.dirname(os.path.abspath(BIN)), "artifacts", "webui.png")
WAIT = 30 * SLOW  # seconds a DOM condition may take
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
KEY = "webui-test-key"


def url_of(name):
    return "/" if name == "index.html" else "/webui/" + name


def web_files():
    return sorted(n for n in os.listdir(WEB) if not n.startswith("."))


# ---------------------------------------------------------------- servers and the browser

@pytest.fixture(scope="module")
def web_server(model_path):
    s = KvServer(["-c", "2048"]).start()
    yield s
    s.terminate()


@pytest.fixture(scope="module")
def key_server(model_path):
    s = KvServer(["-c", "512", "--api-key", KEY]).start()
    yield s
    s.terminate()


def chromium_paths():
    """(browser, driver) paths of Debian's chromium and chromium-driver, or (None, None)."""
    browser = next((p for p in ("/usr/lib/chromium/chromium", shutil.which("chromium"),
                                shutil.which("chromium-browser")) if p and os.access(p, os.X_OK)),
                   None)
    return browser, shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    chrome, driver = chromium_paths()
    if not chrome or not driver:
        if shutil.which("apt-get"):  # scripts/setup.sh installs them here: missing is a bug
            pytest.fail("chromium or chromedriver missing: run scripts/setup.sh (Debian packages "
                        "chromium and chromium-driver)")
        pytest.skip("no chromium here and no apt-get to install it (scripts/setup.sh is for "
                    "Debian): the browser test needs chromium and chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1000", "--force-device-scale-factor=1",
                "--disable-extensions", "--no-first-run", "--disable-background-networking"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(driver), options=opts)
    d.set_page_load_timeout(WAIT)
    yield d
    d.quit()


def wait_for(d, cond, what):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait
    # a pane re-rendered between finding an element and reading it: read it again
    return WebDriverWait(d, WAIT, poll_frequency=0.05,
                         ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda drv: cond(drv), message=f"waited {WAIT} s for {what}")


def texts(d, selector):
    """The text of every element matching selector, read in one script: the cache pane
    re-renders its tables every few seconds, so an element found by one WebDriver call can be
    gone by the next."""
    return d.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]), e => e.innerText.trim())",
        selector)


def pane_rows(d, table):
    return set(d.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]),"
        " e => e.getAttribute('data-row'))", f"#{table} tr[data-row]"))


def css(d, selector):
    from selenium.webdriver.common.by import By
    return d.find_elements(By.CSS_SELECTOR, selector)


def console_errors(d):
    """The browser console's errors since the last call (the log drains as it is read)."""
    return [e for e in d.get_log("browser") if e["level"] == "SEVERE"]


def open_page(d, srv, state="ready"):
    d.get(srv.url + "/")
    wait_for(d, lambda drv: css(drv, "body")[0].get_attribute("data-state") == state,
             f"the page to be {state}")


def ask(d, question, max_tokens, temperature="0", enter=False):
    """Types a question and sends it; returns the new answer's element."""
    from selenium.webdriver.common.keys import Keys
    n = len(css(d, ".msg.assistant"))
    for field, value in (("#max-tokens", str(max_tokens)), ("#temperature", temperature)):
        el = css(d, field)[0]
        el.clear()
        el.send_keys(value)
    box = css(d, "#prompt")[0]
    box.send_keys(question)
    if enter:
        box.send_keys(Keys.ENTER)
    else:
        css(d, "#send")[0].click()
    wait_for(d, lambda drv: len(css(drv, ".msg.assistant")) == n + 1, "the answer to open")
    return css(d, ".msg.assistant")[-1]


def finished(answer):
    from selenium.webdriver.support.ui import WebDriverWait
    WebDriverWait(answer.parent, WAIT, poll_frequency=0.05).until(
        lambda _: answer.get_attribute("data-state") != "streaming",
        message="waited for the answer to end")
    return answer.get_attribute("data-state")


def usage(answer):
    """The numbers shown under an answer: {key: text}."""
    return {dd.get_attribute("data-k"): dd.text for dd in answer.find_elements("css selector",
                                                                               ".usage dd")}


def screenshot_whole_page(d, path):
    """A PNG of the whole page: the window grown to its height, the charts redrawn for it."""
    size = d.get_window_size()
    height = d.execute_script("return document.documentElement.scrollHeight")
    polls = int(css(d, "#cache-pane")[0].get_attribute("data-polls"))
    d.set_window_size(size["width"], height + size["height"] - d.execute_script(
        "return window.innerHeight"))
    wait_for(d, lambda drv: int(css(drv, "#cache-pane")[0].get_attribute("data-polls")) > polls,
             "the charts to be redrawn at the new size")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    assert d.save_screenshot(path), path
    assert os.path.getsize(path) > 10000
    d.set_window_size(size["width"], size["height"])


# ---------------------------------------------------------------- the files

def test_served_files_are_the_sources_with_their_headers(web_server):
    names = web_files()
    assert "index.html" in names and "app.js" in names, names
    for name in names:
        with open(os.path.join(WEB, name), "rb") as f:
            src = f.read()
        r = requests.get(web_server.url + url_of(name), timeout=WAIT)
        assert r.status_code == 200, (name, r.status_code, r.text[:200])
        assert r.content == src, f"{name}: the binary serves other bytes: rebuild (make)"
        assert r.headers["Content-Type"] == CONTENT_TYPES[os.path.splitext(name)[1]], r.headers
        assert r.headers["Content-Security-Policy"] == CSP
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        assert r.headers["Cache-Control"] == "no-cache"
        etag = r.headers["ETag"]
        assert etag == '"' + hashlib.sha256(src).hexdigest()[:32] + '"', (name, etag)
        again = requests.get(web_server.url + url_of(name), headers={"If-None-Match": etag},
                             timeout=WAIT)
        assert again.status_code == 304 and again.content == b"", (name, again.status_code)
        assert again.headers["ETag"] == etag
    r = requests.get(web_server.url + "/webui/missing.js", timeout=WAIT)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    r = requests.post(web_server.url + "/", data=b"x", timeout=WAIT)
    assert r.status_code == 405 and r.headers["Allow"] == "GET", (r.status_code, r.headers)


# ---------------------------------------------------------------- the page

def test_page_loads_and_streams_an_answer(web_server, browser):
    d = browser
    open_page(d, web_server)
    assert css(d, "#model")[0].text == web_server.model_id
    answer = ask(d, "What is the capital of France? Answer in one sentence.", 24)
    assert finished(answer) == "done", answer.text
    text = answer.find_element("css selector", ".text").text
    assert "paris" in text.lower(), text
    # the text came in pieces: one per streamed delta, shown as they came
    assert int(answer.get_attribute("data-deltas")) > 1, answer.get_attribute("data-deltas")
    u = usage(answer)
    assert int(u["prompt_tokens"]) > 10, u
    assert int(u["completion_tokens"]) > 1, u
    assert u["ttft"].endswith(("ms", " s")), u
    assert "blended_tokens" not in u, "blend reported on a plain prompt"
    assert console_errors(d) == []


def test_repeated_question_shows_cached_tokens_and_a_pool_hit(web_server, browser):
    d = browser
    open_page(d, web_server)
    question = "Name three colours of the rainbow."
    answer = ask(d, question, 8, enter=True)  # Enter sends too
    assert finished(answer) == "done"
    first = usage(answer)
    css(d, "#new-chat")[0].click()
    assert css(d, ".msg") == []
    before = web_server.metrics()
    answer = ask(d, question, 8)
    assert finished(answer) == "done"
    second = usage(answer)
    assert second["prompt_tokens"] == first["prompt_tokens"], (first, second)
    # the whole prompt but its last, partly filled block comes from the cache
    assert int(second["cached_tokens"]) > int(first["cached_tokens"]), (first, second)
    assert int(second["cached_tokens"]) >= int(second["prompt_tokens"]) - 16, second

    # the cache pane, refreshed after the answer, counts the repeat's pool hit and its TTFT
    # with reuse: more than the server had counted before it
    def pane_number(drv, table, row, key):
        cell = texts(drv, f'#{table} tr[data-row="{row}"] td[data-k="{key}"]')
        return int(cell[0].replace(",", "")) if cell and cell[0] not in ("–", "") else -1
    hits = before['kvserve_cache_hits_total{tier="pool"}']
    cached = before['kvserve_time_to_first_token_by_reuse_seconds_count{reuse="cached"}']
    wait_for(d, lambda drv: (pane_number(drv, "hits-table", "pool", "hits") > hits
                             and pane_number(drv, "ttft-table", "cached", "requests") > cached),
             "the cache pane to show the repeat's pool hit")
    rows = pane_rows(d, "occupancy-table")
    assert {"pool", "ram"} <= rows, rows
    share = texts(d, '#occupancy-table tr[data-row="pool"] td[data-k="share"]')[0]
    assert share.endswith("%") and share != "0%", share
    assert "came from the cache" in texts(d, "#reuse-summary")[0]
    assert texts(d, "#schemas-table caption")[0].startswith("no schemas registered")
    assert css(d, "#cache-error")[0].is_displayed() is False
    screenshot_whole_page(d, ARTIFACT)
    assert console_errors(d) == []


def test_stop_ends_an_answer_and_the_chat_goes_on(web_server, browser):
    d = browser
    open_page(d, web_server)
    answer = ask(d, "Write a long story about a dragon who loves to cook.", 600)
    wait_for(d, lambda _: answer.find_element("css selector", ".text").text != "",
             "the first words")
    css(d, "#stop")[0].click()
    assert finished(answer) == "stopped"
    assert "stopped" in answer.text
    assert 0 < len(answer.find_element("css selector", ".text").text.split()) < 400
    # the partial answer stays in the conversation, and the next question is answered
    nxt = ask(d, "Thanks. Now in one word: what is the dragon's favourite food?", 8)
    assert finished(nxt) == "done"
    assert int(usage(nxt)["cached_tokens"]) > 0
    assert console_errors(d) == []


def test_api_key_is_asked_for_and_sent(key_server, browser):
    d = browser
    # the page itself is public; the API is not
    assert requests.get(key_server.url + "/", timeout=WAIT).status_code == 200
    assert requests.get(key_server.url + "/v1/models", timeout=WAIT).status_code == 401
    open_page(d, key_server, state="auth")
    assert css(d, "#auth")[0].is_displayed()
    msg = css(d, "#auth-message")[0].text
    assert "needs an API key" in msg and "401" in msg, msg
    assert css(d, "#send")[0].get_attribute("disabled") is not None

    key_input = css(d, "#key-input")[0]
    key_input.send_keys("wrong-key")
    css(d, "#key-form button[type=submit]")[0].click()
    wait_for(d, lambda drv: "refused" in css(drv, "#auth-message")[0].text,
             "the wrong key to be refused")

    key_input.send_keys(KEY)
    css(d, "#key-form button[type=submit]")[0].click()
    wait_for(d, lambda drv: css(drv, "body")[0].get_attribute("data-state") == "ready",
             "the page to accept the key")
    assert not css(d, "#auth")[0].is_displayed()
    assert css(d, "#model")[0].text == key_server.model_id
    assert d.execute_script("return sessionStorage.getItem('kvserve.apiKey')") == KEY
    answer = ask(d, "Say hello.", 4)
    assert finished(answer) == "done"
    wait_for(d, lambda drv: int(css(drv, "#cache-pane")[0].get_attribute("data-polls")) > 0,
             "the cache pane to load /v1/cache/stats with the key")
    assert css(d, "#cache-error")[0].is_displayed() is False
    # the console's errors are the refused calls' 401s, nothing else
    errors = console_errors(d)
    assert errors and all("401" in e["message"] for e in errors), errors

    # a reload keeps the key for the tab
    open_page(d, key_server)


def test_no_webui_answers_404(start_server):
    s = start_server("-c", "256", "--no-webui")
    for path in ("/", "/webui/app.js"):
        r = requests.get(s.url + path, timeout=WAIT)
        assert r.status_code == 404, (path, r.status_code)
        assert r.headers["Content-Type"].startswith("application/json")
        err = r.json()["error"]
        assert err["code"] == "not_found" and err["type"] == "invalid_request_error", err
        assert "Content-Security-Policy" not in r.headers
    assert requests.get(s.url + "/health", timeout=WAIT).status_code == 200
