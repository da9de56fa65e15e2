"""The dashboard's chat with a GPT-OSS model, in Chromium against one real node: the analysis channel
shows in the answer's collapsible reasoning block, the final channel as the answer, and both are
still there when the page is opened again (the conversation is kept in the browser).

The node serves the scripted gpt_oss model (tests/gptoss_model.py) with the page's default
sampling (no temperature typed: the server's 0.8, top-k 40): the script's margins hold under it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, Locator, Page

from tests.browser import chromium, open_page
from tests.gptoss_model import ANSWER, ANSWER_SCRIPT, REASONING, script_ids
from tests.nodes import RunningNode


@pytest.fixture(scope="module")
def node(scripted_gptoss_node: RunningNode) -> RunningNode:
    return scripted_gptoss_node


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as chrome:
        yield chrome


def _reasoning_and_answer(answer: Locator) -> tuple[str, str]:
    """The text of an answer's reasoning block (opened first: a closed one shows only its summary)
    and of its body."""
    block = answer.locator("details.reasoning")
    assert block.is_visible()
    if block.get_attribute("open") is None:
        block.locator("summary").click()
    return block.locator(".md").inner_text().strip(), answer.locator(".body").inner_text().strip()


def test_the_answer_shows_its_reasoning(browser: Browser, node: RunningNode) -> None:
    page: Page
    page, console = open_page(browser, node.base_url + "/")
    page.wait_for_function("() => document.querySelector('#model-select').value !== ''")
    page.fill("#prompt", "Say hello.")
    page.press("#prompt", "Enter")
    answer = page.locator(".msg.assistant").last
    answer.locator(".usage").wait_for(timeout=60_000)
    assert _reasoning_and_answer(answer) == (REASONING, ANSWER)
    assert f"+ {len(script_ids(ANSWER_SCRIPT))} tokens" in answer.locator(".usage").inner_text()

    page.reload()
    kept = page.locator(".msg.assistant").last
    kept.wait_for()
    assert _reasoning_and_answer(kept) == (REASONING, ANSWER)
    assert console.errors == []
