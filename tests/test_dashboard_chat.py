"""The dashboard's chat settings and prefill ETA, in Chromium against one real node.

The node serves the random model with a generation_config.json (temperature 0.6, top-p 0.9): the
page shows those as the model's and the rest as the server's defaults, sends a typed temperature
and none when the field is empty. The prefill ETA appears only once a rate is measured: a fresh
page's first long prompt shows none at its first two progress events (the rule itself is checked
on `PrefillEta` with given times, as a remembered rate from an earlier request of the same model).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page

from tests.browser import Console, chromium, open_page
from tests.nodes import RunningNode, start_node

STEP = 16
"""The node's `--prefill-step-size`: a ~1500-token prompt reports ~90 progress events."""
CONFIG = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}


@pytest.fixture(scope="module")
def node(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningNode]:
    model = tmp_path_factory.mktemp("sampled") / "tiny-sampled"
    shutil.copytree(random_model_dir, model)
    (model / "generation_config.json").write_text(json.dumps(CONFIG))
    running = start_node(
        "--prefill-step-size", str(STEP), data_dir=tmp_path_factory.mktemp("data"), model=str(model)
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as chrome:
        yield chrome


def fresh_page(browser: Browser, node: RunningNode) -> tuple[Page, Console]:
    """A page of its own (storage and module state), with the model in the picker."""
    page, console = open_page(browser, node.base_url + "/")
    page.wait_for_function("() => document.querySelector('#model-select').value !== ''")
    return page, console


def send(page: Page, text: str, max_tokens: int) -> dict[str, Any]:
    """Send a chat turn; the body the page posted. Waits for the answer's usage line."""
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", text)
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant:last-child .usage", timeout=60_000)
    body = sent.value.post_data_json
    assert isinstance(body, dict)
    return body


def test_shows_the_effective_sampling_and_sends_only_a_typed_temperature(
    browser: Browser, node: RunningNode
) -> None:
    page, console = fresh_page(browser, node)
    info = page.locator("#sampling-info")
    page.wait_for_function(
        "() => document.querySelector('#sampling-info').textContent.includes('temperature')"
    )
    text = info.inner_text()
    for shown in ("temperature 0.6 (model)", "top-p 0.9 (model)", "top-k 40 (server)", "min-p 0.05 (server)"):
        assert shown in text, text
    assert "temperature" not in send(page, "Hello", max_tokens=2)  # empty field: the model's default

    page.fill("#temperature", "0")
    assert "temperature 0 (yours)" in info.inner_text()
    assert send(page, "Hello again", max_tokens=2)["temperature"] == 0
    page.fill("#temperature", "")
    assert "temperature 0.6 (model)" in info.inner_text()
    assert console.errors == []


RECORD_LABELS = """() => {
  window.__labels = [];
  new MutationObserver((mutations) => {
    for (const m of mutations) {
      if (m.target.classList && m.target.classList.contains("prefill-label")) {
        for (const node of m.addedNodes) window.__labels.push(node.textContent);
      }
    }
  }).observe(document.getElementById("messages"), { subtree: true, childList: true });
}"""


def test_no_eta_before_a_rate_is_measured(browser: Browser, node: RunningNode) -> None:
    """Each label the bar showed, in order (a text node per progress event, recorded as added)."""
    page, console = fresh_page(browser, node)
    page.evaluate(RECORD_LABELS)
    send(page, "tide " * 1500, max_tokens=2)
    labels: list[str] = page.evaluate("window.__labels")
    assert len(labels) >= 5, labels
    assert labels[0].startswith("Processing prompt: 0 / ") and "ETA" not in labels[0], labels[:3]
    assert "ETA" not in labels[1], labels[:3]
    assert any("ETA" in label for label in labels[2:]), labels
    assert console.errors == []


def test_prefill_eta_rule(browser: Browser, node: RunningNode) -> None:
    page, _ = fresh_page(browser, node)
    etas = page.evaluate(
        """async () => {
          const { PrefillEta } = await import("/web/eta.js");
          const first = new PrefillEta("m");
          const seen = [first.see(0, 2514, 0), first.see(78, 2514, 1.5), first.see(590, 2514, 501.5)];
          const next = new PrefillEta("m");  // a later request of the same model: the rate it left
          const other = new PrefillEta("other");
          return [...seen, next.see(0, 2048, 9000), other.see(0, 2048, 9000)];
        }"""
    )
    # 0 -> 78 tokens in 1.5 ms is a prefix-cache hit, not a rate: none until the third event, then
    # 512 tokens in 0.5 s; the next request of "m" starts with that rate, another model with none.
    assert etas == [None, None, pytest.approx((2514 - 590) / 1024), pytest.approx(2.0), None]
