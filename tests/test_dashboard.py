"""The web dashboard in a real browser (Chromium via Playwright) against a real 3-node cluster.

The tests run in file order as one story on one cluster and one page (module-scoped, so the nodes
and the model load once): the page loads clean, shows the nodes and the leader, launches the model
from its list (preview first), chats with it, shows a long prompt's prefill progress, stops an
answer, deletes the instance, and marks a killed node dead. Screenshots go to each test's tmp_path.

Model output containing `<script>` cannot be produced on demand by a random-weight model, so that
test takes the real paths that do not need it: the user's own `<script>` through a real chat turn
(user and assistant text go through the same Markdown renderer), an assistant answer with raw HTML
rendered from the conversation store as the page does after a reload, and the renderer itself on
a crafted string in the page.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page

from tests.browser import Console, chromium, open_page
from tests.nodes import RunningNode, agreed_leader, start_node
from tests.waiting import wait_until

STEP = 16
"""The nodes' `--prefill-step-size`: a ~1500-token prompt then reports ~90 progress events."""
LONG_PROMPT = "word " * 1500
BROKEN = "broken-llama"
XSS = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'


@pytest.fixture(scope="module")
def broken_model_dir(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random model with an architecture mlx-lm does not know: it places, then fails to load."""
    broken = tmp_path_factory.mktemp("broken") / BROKEN
    shutil.copytree(random_model_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch"}))
    return broken


@pytest.fixture(scope="module")
def cluster(
    random_model_dir: Path, broken_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[RunningNode]]:
    """Three nodes serving nothing yet, each with the random and the broken model in its data dir."""

    def start(index: int, *peer: str) -> RunningNode:
        data = tmp_path_factory.mktemp(f"dash{index}")
        (data / "models").mkdir()
        for model in (random_model_dir, broken_model_dir):
            (data / "models" / model.name).symlink_to(model)
        return start_node(*peer, "--prefill-step-size", str(STEP), data_dir=data, model=None)

    nodes = [start(0)]
    try:
        with ThreadPoolExecutor(2) as pool:
            nodes += pool.map(lambda i: start(i, "--peer", nodes[0].p2p_addr), (1, 2))
        wait_until(lambda: agreed_leader(nodes), 20, "agreed on one leader")
        yield nodes
    finally:
        for node in nodes:
            node.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as chrome:
        yield chrome


@pytest.fixture(scope="module")
def dashboard(browser: Browser, cluster: list[RunningNode]) -> tuple[Page, Console]:
    return open_page(browser, cluster[0].base_url + "/")


def shot(page: Page, tmp_path: Path, name: str) -> None:
    page.screenshot(path=str(tmp_path / f"{name}.png"), full_page=True)


def test_page_loads_without_console_errors(dashboard: tuple[Page, Console], tmp_path: Path) -> None:
    page, console = dashboard
    page.wait_for_selector("article.node")
    page.wait_for_selector("#live[data-mode=push]")
    page.wait_for_selector(f"#model-rows tr[data-model='{BROKEN}']")
    shot(page, tmp_path, "loaded")
    assert console.errors == []
    assert page.title() == "Shoal"


def test_files_are_served_from_the_package_only(cluster: list[RunningNode]) -> None:
    base = cluster[0].base_url
    page = httpx.get(f"{base}/", timeout=10)
    assert page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    module = httpx.get(f"{base}/web/app.js", timeout=10)
    assert module.headers["content-type"].startswith("text/javascript")
    assert module.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(f"{base}/web/vendor/README.txt", timeout=10).status_code == 200
    for outside in ("/web/%2e%2e/dashboard.py", "/web/..%2fdashboard.py", "/web/nope.js", "/web/vendor"):
        assert httpx.get(f"{base}{outside}", timeout=10).status_code == 404, outside


def test_polls_when_the_push_stream_is_cut(browser: Browser, cluster: list[RunningNode]) -> None:
    """A proxy that breaks event streams: the page says so and polls `/v1/dashboard/state` instead."""
    context = browser.new_context()
    context.set_default_timeout(20_000)
    context.route("**/v1/cluster/events", lambda route: route.abort())
    page = context.new_page()
    page.goto(cluster[0].base_url + "/")
    page.wait_for_selector("#live[data-mode=polling]")
    page.wait_for_function("() => document.querySelectorAll('article.node').length === 3")
    context.close()


def test_three_nodes_and_the_leader(dashboard: tuple[Page, Console], cluster: list[RunningNode]) -> None:
    page, _ = dashboard
    leader = wait_until(lambda: agreed_leader(cluster), 20, "agreed on one leader")
    page.wait_for_function("() => document.querySelectorAll('article.node[data-status=alive]').length === 3")
    cards = page.locator("article.node")
    assert sorted(cards.evaluate_all("cs => cs.map(c => c.dataset.nodeId)")) == sorted(
        n.node_id for n in cluster
    )
    leaders = page.locator("article.node[data-role=leader]")
    page.wait_for_function(
        f"() => document.querySelector('article.node[data-role=leader]')?.dataset.nodeId === {leader!r}"
    )
    assert leaders.count() == 1 and leaders.locator(".badge.leader").inner_text() == "leader"
    for node in cluster:  # the full id in a title, a short form shown
        label = page.locator(f"article.node[data-node-id='{node.node_id}'] .node-id")
        assert label.get_attribute("title") == node.node_id
        assert label.inner_text() == f"…{node.node_id[-8:]}"
    card = page.locator(f"article.node[data-node-id='{cluster[0].node_id}']")
    assert card.locator("[role=meter]").get_attribute("aria-valuemax") not in (None, "0")
    assert re.search(r"GB / [\d.]+ GB used", card.inner_text())


def test_api_key_is_sent_once_set(dashboard: tuple[Page, Console]) -> None:
    page, _ = dashboard
    page.click("#key-summary")
    page.fill("#api-key", "sk-dashboard-test")
    with (
        page.expect_request(lambda r: "/v1/cluster/events" in r.url) as pushed,
        page.expect_request(lambda r: r.url.endswith("/v1/dashboard/models")) as listed,
    ):
        page.click("#key-form button")
    for request in (pushed.value, listed.value):
        assert request.headers["authorization"] == "Bearer sk-dashboard-test"
    assert page.evaluate("localStorage.getItem('shoal.apiKey')") == "sk-dashboard-test"
    page.click("#key-summary")
    page.fill("#api-key", "")
    with page.expect_request(lambda r: "/v1/cluster/events" in r.url) as pushed:
        page.click("#key-form button")
    assert "authorization" not in pushed.value.headers
    page.wait_for_selector("#live[data-mode=push]")


def test_launch_with_preview_then_ready(
    dashboard: tuple[Page, Console], cluster: list[RunningNode], random_model_dir: Path, tmp_path: Path
) -> None:
    page, _ = dashboard
    model = random_model_dir.name
    row = page.locator(f"#model-rows tr[data-model='{model}']")
    assert "yes, on 1 node" in row.inner_text() and row.locator("td").nth(2).inner_text().endswith("MB")
    row.get_by_role("button", name="Launch…").click()
    preview = page.locator("#preview")
    preview.get_by_text(f"Placement preview: {model}").wait_for()
    assert preview.locator(".node-id").count() == 1 and "layers" in preview.inner_text()
    shot(page, tmp_path, "preview")
    assert httpx.get(f"{cluster[0].base_url}/v1/instances", timeout=10).json()["data"] == []  # only a preview
    preview.get_by_role("button", name="Launch", exact=True).click()
    page.locator(f"#instance-rows tr[data-model='{model}']").first.wait_for()
    seen = page.evaluate("document.querySelector('#instance-rows tr')?.dataset.state")
    assert seen in ("placing", "loading", "ready")
    page.wait_for_selector(f"#instance-rows tr[data-model='{model}'][data-state=ready]", timeout=60_000)
    shot(page, tmp_path, "ready")
    [instance] = httpx.get(f"{cluster[0].base_url}/v1/instances", timeout=10).json()["data"]
    node = instance["stages"][0]["node_id"]
    assert page.locator(f"article.node[data-node-id='{node}'] .stages").inner_text().startswith(model)


def send(page: Page, text: str, max_tokens: int | None) -> None:
    page.fill("#max-tokens", "" if max_tokens is None else str(max_tokens))
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last_answer_done(page: Page) -> None:
    page.wait_for_selector(".msg.assistant:last-child .usage", timeout=60_000)


def test_chat_answers_and_user_script_stays_text(dashboard: tuple[Page, Console], tmp_path: Path) -> None:
    page, console = dashboard
    page.wait_for_function("() => document.querySelector('#model-select').options.length > 0")
    page.fill("#prompt", "first line")
    page.press("#prompt", "Shift+Enter")
    page.keyboard.type("second line")
    assert page.input_value("#prompt") == "first line\nsecond line"  # Shift+Enter did not send
    send(page, f"Hello {XSS} **bold**", max_tokens=8)
    last_answer_done(page)
    answer = page.locator(".msg.assistant").last
    assert answer.locator(".body").inner_text().strip() != ""
    assert re.search(r"\d+ prompt \+ \d+ tokens", answer.inner_text())
    assert re.search(r"[\d.]+ tok/s", answer.locator(".speed").inner_text())
    user = page.locator(".msg.user").last
    assert "<script>window.__pwned = 1</script>" in user.inner_text()
    assert user.locator("strong").inner_text() == "bold"  # Markdown, but no HTML
    assert page.locator("#messages script, #messages img").count() == 0
    assert page.evaluate("window.__pwned") is None
    stored = page.evaluate("JSON.parse(localStorage.getItem('shoal.conversations'))")
    assert [m["role"] for m in stored[0]["messages"]] == ["user", "assistant"]
    shot(page, tmp_path, "chat")
    assert console.errors == []


RECORD_PROGRESS = """() => {
  window.__progress = [];
  const record = (value) => { if (value !== null) window.__progress.push(Number(value)); };
  window.__progressObserver = new MutationObserver((mutations) => {
    for (const m of mutations) {
      if (m.type === "attributes") record(m.oldValue);
      const bar = document.querySelector("#messages [role=progressbar]");
      if (bar) {
        record(bar.getAttribute("aria-valuenow"));
        window.__progressText = bar.textContent;
        window.__progressMax = Number(bar.getAttribute("aria-valuemax"));
      }
    }
  });
  window.__progressObserver.observe(document.getElementById("messages"), {
    subtree: true, childList: true, attributes: true, attributeOldValue: true,
    attributeFilter: ["aria-valuenow"],
  });
}"""


def test_long_prompt_shows_prefill_progress(dashboard: tuple[Page, Console], tmp_path: Path) -> None:
    page, _ = dashboard
    page.click("#new-chat")
    page.evaluate(RECORD_PROGRESS)
    send(page, LONG_PROMPT, max_tokens=4)
    bar = page.locator("#messages [role=progressbar]")
    # The observer saw the bar (a poll for it being visible can miss a short prefill).
    page.wait_for_function("() => window.__progressMax !== undefined", timeout=30_000)
    shot(page, tmp_path, "prefill")
    last_answer_done(page)
    assert bar.count() == 0  # gone once tokens came
    values: list[float] = page.evaluate("window.__progress")
    total: float = page.evaluate("window.__progressMax")
    distinct = sorted(set(values))
    assert len(distinct) >= 5, values
    assert distinct == sorted(distinct) and distinct[-1] <= total and total >= 1500
    assert re.fullmatch(
        r"Processing prompt: \d+ / \d+ tokens · ETA .+", page.evaluate("window.__progressText")
    )
    usage = re.search(r"(\d+) prompt", page.locator(".msg.assistant .usage").last.inner_text())
    assert usage is not None
    prompt_tokens = int(usage[1])
    assert total <= prompt_tokens  # progress counts what is computed: a cached prefix is not


def test_stop_cancels_on_the_server(dashboard: tuple[Page, Console], cluster: list[RunningNode]) -> None:
    page, _ = dashboard
    entry = next(n for n in cluster if health_runner(n) is not None)
    before = health_runner(entry)["cancelled"]  # type: ignore[index]
    send(page, "Tell me a very long story.", max_tokens=None)
    page.locator("#stop").wait_for(state="visible")
    page.wait_for_function(
        "() => document.querySelector('.msg.assistant:last-child .body')?.textContent.length > 20"
    )
    with page.expect_response(lambda r: "/v1/cancel/" in r.url) as cancel:
        page.click("#stop")
    assert cancel.value.status == 200 and cancel.value.request.method == "POST"
    assert cancel.value.url.rsplit("/", 1)[-1].startswith("chatcmpl-")
    page.locator("#send").wait_for(state="visible")
    assert page.locator(".msg.assistant").last.locator(".stopped").count() == 1
    wait_until(lambda: health_runner(entry)["cancelled"] > before, 10, "cancelled on the server")  # type: ignore[index]
    assert health_runner(entry)["active_requests"] == 0  # type: ignore[index]


def health_runner(node: RunningNode) -> dict[str, Any] | None:
    runners = node.health()["runners"]
    return runners[0] if runners else None


def test_assistant_html_is_shown_as_text(dashboard: tuple[Page, Console], tmp_path: Path) -> None:
    page, _ = dashboard
    rendered = page.evaluate(
        """async (text) => {
          const { renderMarkdown } = await import("/web/markdown.js");
          const box = document.createElement("div");
          box.innerHTML = renderMarkdown(text);
          return { text: box.textContent, tags: [...box.querySelectorAll("*")].map(e => e.tagName),
                   href: box.querySelector("a")?.getAttribute("href") ?? null };
        }""",
        f"{XSS}\n\n[link](javascript:window.__pwned=3) *fine*",
    )
    assert "<script>window.__pwned = 1</script>" in rendered["text"]
    assert set(rendered["tags"]) <= {"P", "A", "EM", "BR"} and rendered["href"] is None
    # An answer with raw HTML in the conversation store, drawn as the page draws history.
    conversation = {
        "id": "crafted",
        "title": "crafted",
        "model": "",
        "updated": 0,
        "messages": [
            {"role": "user", "content": "show me html"},
            {
                "role": "assistant",
                "content": f"Here: {XSS}\n\n```html\n<script>x()</script>\n```",
                "reasoning": XSS,
            },
        ],
    }
    page.evaluate(
        """(c) => { localStorage.setItem("shoal.conversations", JSON.stringify([c]));
                   localStorage.setItem("shoal.currentConversation", c.id); }""",
        conversation,
    )
    page.reload()
    answer = page.locator(".msg.assistant").last
    answer.wait_for()
    assert "Here: <script>window.__pwned = 1</script>" in answer.locator(".body").inner_text()
    assert "<script>x()</script>" in answer.locator("pre").inner_text()
    answer.locator(".reasoning summary").click()
    assert "<script>" in answer.locator(".reasoning").inner_text()
    assert page.locator("#messages script, #messages img").count() == 0
    assert page.evaluate("window.__pwned") is None
    shot(page, tmp_path, "html-as-text")


def test_delete_from_the_page(dashboard: tuple[Page, Console], cluster: list[RunningNode]) -> None:
    page, _ = dashboard
    row = page.locator("#instance-rows tr[data-instance-id]")
    row.get_by_role("button", name="Delete").click()
    row.wait_for(state="detached", timeout=15_000)
    assert httpx.get(f"{cluster[0].base_url}/v1/instances", timeout=10).json()["data"] == []
    page.locator("#no-instances").wait_for(state="visible")


def test_a_model_that_cannot_load_shows_failed_with_the_reason(
    dashboard: tuple[Page, Console], tmp_path: Path
) -> None:
    page, _ = dashboard
    page.fill("#launch-ref", BROKEN)  # the free-text way, for a change
    page.click("#launch-form button")
    page.locator("#launch-confirm").click()
    failed = page.locator(f"#instance-rows tr[data-model='{BROKEN}'][data-state=failed]")
    failed.wait_for(timeout=60_000)
    assert "Model type no_such_arch not supported" in failed.locator(".reason").inner_text()
    shot(page, tmp_path, "failed")
    failed.get_by_role("button", name="Delete").click()
    failed.wait_for(state="detached", timeout=15_000)


def test_killed_node_turns_dead(
    dashboard: tuple[Page, Console], cluster: list[RunningNode], tmp_path: Path
) -> None:
    page, _ = dashboard
    victim = cluster[2]
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait(10)
    page.wait_for_selector(f"article.node[data-node-id='{victim.node_id}'][data-status=dead]", timeout=20_000)
    card = page.locator(f"article.node[data-node-id='{victim.node_id}']")
    assert card.locator(".badge.status").inner_text() == "dead"
    page.wait_for_function("() => document.querySelectorAll('article.node[data-status=alive]').length === 2")
    shot(page, tmp_path, "dead")
