"""The dashboard in a real browser: `streamlit run app.py` served on a free port, driven by
headless Chromium through Playwright's sync API.

AppTest (tests/test_app*.py) runs the script without a frontend; this checks what only a
browser shows: the Plan page renders its verdict and peak, typing a new batch size into the
sidebar recomputes them, and the address bar carries the new value as a shareable link.

Needs Debian's `chromium` at /usr/bin/chromium (or $CHROMIUM) and the `playwright` Python
package; Playwright's own browser download is not used. Skipped, with the reason, without
either. SAVE_SCREENSHOT=1 also writes docs/plan_page.png (the README's picture).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from planner.estimate import estimate
from planner.loading import load_model_shape
from planner.scenario import scenario_from_values
from planner.units import format_bytes
from views.inputs import DEFAULTS, GPU_PRESETS

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
SCREENSHOT = ROOT / "docs" / "plan_page.png"
SERVER_START_S = 60
RENDER_TIMEOUT_MS = 45_000  # the first script run imports transformers and builds the shape
BATCH_LABEL = "Batch size (sequences per micro-batch)"
BIG_BATCH = 256  # distilbert-base-cased at 512 tokens, AdamW fp32: about 39 GiB, over a T4's 15 GiB
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    # Without these Chromium's background connections fail on a closed network and slow it down.
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
SCENARIO_KEYS = ("task", "batch_size", "seq_len", "optimizer", "precision", "gradient_checkpointing",
                 "grad_accum", "attn", "device", "num_labels")

if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install -y chromium, or set $CHROMIUM)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed "
                                                            "(pip install -r requirements-dev.txt)")


def expected_peak(**overrides) -> int:
    values = {key: DEFAULTS[key] for key in SCENARIO_KEYS} | overrides
    scenario = scenario_from_values(**values)
    return estimate(load_model_shape(DEFAULTS["catalog_model"], scenario.task, scenario.num_labels),
                    scenario).peak_bytes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"streamlit exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    pytest.fail(f"streamlit did not serve {url} within {SERVER_START_S} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def server_url(tmp_path_factory, request) -> str:
    tmp = tmp_path_factory.mktemp("browser")
    port = free_port()
    log = tmp / "streamlit.log"
    env = {**os.environ, "PLANNER_DATA_DIR": str(tmp / "data"), "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false"}
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "scripts/serve.py", "--server.port", str(port),  # as scripts/dashboard.sh starts it
             "--server.headless", "true", "--server.address", "127.0.0.1"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def stop() -> None:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=10)

    request.addfinalizer(stop)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(url, server, log)
    return url


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    # A persistent context on a fresh profile directory: Chromium starts from a clean
    # --user-data-dir (Playwright passes it itself; it refuses the flag in args).
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1440, "height": 1100})
        try:
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()
    shutil.rmtree(profile, ignore_errors=True)


def metric_value(page, label: str):
    metric = page.get_by_test_id("stMetric").filter(
        has=page.get_by_test_id("stMetricLabel").get_by_text(label, exact=True))
    return metric.get_by_test_id("stMetricValue")


def test_plan_page_recomputes_when_the_batch_size_changes(server_url, page):
    expect = sync_api.expect
    assert DEFAULTS["gpu_preset"] == "T4 · 16 GB" and GPU_PRESETS["T4 · 16 GB"] < expected_peak(batch_size=BIG_BATCH)
    small_peak, big_peak = format_bytes(expected_peak()), format_bytes(expected_peak(batch_size=BIG_BATCH))

    scripts = []
    page.on("request", lambda request: scripts.append(request.url) if request.resource_type == "script" else None)
    page.goto(server_url)
    main = page.get_by_test_id("stMain")
    # The default device is CUDA: the verdict is on the caching allocator's replayed reserved peak,
    # overheads aside (planner.device_fit).
    expect(main.get_by_text(re.compile(r"^Fits: the reserved peak of "))).to_be_visible(timeout=RENDER_TIMEOUT_MS)
    peak = metric_value(page, "Peak")
    # The verdict can show while a rerun (the session's first) redraws the page: on 2 loaded cores
    # the metric took longer than Playwright's default 5 s to come back.
    expect(peak).to_have_text(small_peak, timeout=RENDER_TIMEOUT_MS)

    # Both charts are SVG drawn by the server (views.svg_charts): no chart library, and no Arrow
    # table chunk, for a new session to fetch before its first page is complete.
    expect(main.locator("svg.plan-chart")).to_have_count(2, timeout=RENDER_TIMEOUT_MS)
    assert not [url for url in scripts if "PlotlyChart" in url or "arrowFormatUtils" in url], scripts
    if os.environ.get("SAVE_SCREENSHOT") == "1":
        page.wait_for_timeout(500)  # let the charts finish drawing
        SCREENSHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(SCREENSHOT))

    batch = page.get_by_test_id("stSidebar").get_by_label(BATCH_LABEL)
    expect(batch).to_have_value(str(DEFAULTS["batch_size"]))
    batch.fill(str(BIG_BATCH))
    batch.press("Enter")  # a number input commits on Enter or blur

    expect(peak).to_have_text(big_peak, timeout=RENDER_TIMEOUT_MS)
    assert big_peak != small_peak
    expect(main.get_by_text(re.compile(r"^Does not fit: the reserved peak of "))).to_be_visible()
    expect(main.get_by_text(re.compile(r"^Fits: "))).to_have_count(0)
    # app.py mirrors the sidebar into st.query_params: the address bar is a link to this plan.
    try:
        page.wait_for_function(
            "batch => new URLSearchParams(window.location.search).get('batch_size') === batch",
            arg=str(BIG_BATCH), timeout=10_000)
    except sync_api.TimeoutError:
        pytest.fail(f"the URL does not carry batch_size={BIG_BATCH}: {page.url}")


def pick_catalog_model(page, name: str) -> None:
    sidebar = page.get_by_test_id("stSidebar")
    option = page.get_by_role("option", name=name, exact=True)
    for attempt in range(4):  # a click right after a rerun can land before the list opens
        combobox = sidebar.get_by_role("combobox", name="Catalog model", exact=True)
        combobox.click()
        combobox.fill(name)  # filters the list: the catalog is long
        try:
            option.wait_for(timeout=3_000)
            break
        except sync_api.TimeoutError:
            if attempt == 3:
                raise
            page.keyboard.press("Escape")
    option.click()


def test_hidden_sidebar_values_come_back_as_the_user_left_them(server_url, page):
    # Labels shows only for sequence classification: two causal LMs in a row hid it for two
    # runs, and it came back showing its minimum (1) while the server still planned 2; the
    # next change sent the 1 (a 12-class probe nobody asked for). The user's count must
    # survive, in the field, the plan and the link.
    expect = sync_api.expect
    page.goto(server_url)
    sidebar = page.get_by_test_id("stSidebar")
    labels = sidebar.get_by_label("Labels")
    expect(labels).to_have_value(str(DEFAULTS["num_labels"]), timeout=RENDER_TIMEOUT_MS)
    labels.fill("5")
    labels.press("Enter")
    peak = metric_value(page, "Peak")
    expect(peak).to_have_text(format_bytes(expected_peak(num_labels=5)), timeout=RENDER_TIMEOUT_MS)
    for causal_lm in ("gpt2", "qwen2.5-0.5b"):
        pick_catalog_model(page, causal_lm)
        expect(sidebar.get_by_role("combobox", name="Catalog model", exact=True)).to_have_value(
            causal_lm, timeout=RENDER_TIMEOUT_MS)
        expect(labels).to_have_count(0, timeout=RENDER_TIMEOUT_MS)
    pick_catalog_model(page, DEFAULTS["catalog_model"])
    expect(labels).to_have_value("5", timeout=RENDER_TIMEOUT_MS)
    expect(peak).to_have_text(format_bytes(expected_peak(num_labels=5)), timeout=RENDER_TIMEOUT_MS)
    # One more change, so whatever the field holds is sent to the server and planned.
    batch = sidebar.get_by_label(BATCH_LABEL)
    batch.fill("4")
    batch.press("Enter")
    expect(peak).to_have_text(format_bytes(expected_peak(num_labels=5, batch_size=4)), timeout=RENDER_TIMEOUT_MS)
    try:
        page.wait_for_function("() => new URLSearchParams(window.location.search).get('num_labels') === '5'",
                               timeout=10_000)
    except sync_api.TimeoutError:
        pytest.fail(f"the link does not carry the user's 5 labels: {page.url}")
