"""The dashboard's sharding choices in a real browser (Chromium) against two real nodes: the launch
form's preview of a tensor-parallel placement and of "auto" (with the leader's reason), and the round
trip each node card shows. Nothing is launched: the story of `test_dashboard.py` launches as layers."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.browser import chromium, open_page
from tests.nodes import RunningNode
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def page(pair: list[RunningNode]) -> Iterator[Page]:
    with chromium() as browser:
        page, console = open_page(browser, pair[0].base_url + "/")
        yield page
        assert console.errors == []


def _preview(page: Page, model: Path, sharding: str) -> None:
    page.select_option("#launch-sharding", sharding)
    page.fill("#launch-ref", str(model))
    page.click("#launch-form button[type=submit]")


def test_a_tensor_preview_shows_a_rank_on_each_node(page: Page, random_model_dir: Path) -> None:
    """The random model's 2 KV heads make 2 ranks, each a slice of every layer."""
    _preview(page, random_model_dir, "tensor")
    preview = page.locator("#preview")
    preview.get_by_text("tensor-parallel").wait_for()
    assert (
        preview.locator(".node-id").count() == 2 and "rank 1, a slice of every layer" in preview.inner_text()
    )
    preview.get_by_role("button", name="Cancel").click()


def test_auto_shows_what_the_leader_chose_and_why(
    page: Page, pair: list[RunningNode], random_model_dir: Path
) -> None:
    def measured() -> bool:
        return all(m["round_trips_us"] for m in pair[0].cluster()["members"])

    wait_until(measured, 30, "each node measured its round trip to the other")
    _preview(page, random_model_dir, "auto")
    reason = page.locator("#sharding-reason").inner_text()  # waits for the preview
    assert reason.startswith("Chosen: pipeline: 2 ranks would save") and "us round trip" in reason
    page.locator("#preview").get_by_role("button", name="Cancel").click()
    assert httpx.get(f"{pair[0].base_url}/v1/instances", timeout=10).json()["data"] == []


def test_the_other_node_card_shows_the_round_trip_to_it(page: Page, pair: list[RunningNode]) -> None:
    trip = page.locator(f"article.node[data-node-id='{pair[1].node_id}'] .trip")
    expect(trip).to_have_text(re.compile(r"\d+ µs away|[\d.]+ ms away"))
    expect(page.locator(f"article.node[data-node-id='{pair[0].node_id}'] .trip")).to_have_count(0)
