"""The dashboard's "Model files moving" table and model list, in Chromium against a real node.

The node's real `/v1/dashboard/state`, with two transfers added to its member on the way to the
page (one node has no peer to fetch from; tests/test_cluster_files_nodes.py moves real files and
checks the same records in `/v1/cluster`). Its data dir holds a model and a partial copy fetched
from peers (`models/cluster/<id>/`, no sidecar), which must not be offered for launching.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Route

from tests.browser import chromium, open_page
from tests.nodes import RunningNode, start_node

PARTIAL_ID = "ab" * 32


@pytest.fixture(scope="module")
def node(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningNode]:
    data = tmp_path_factory.mktemp("dash-files")
    (data / "models").mkdir()
    (data / "models" / random_model_dir.name).symlink_to(random_model_dir)
    partial = data / "models" / "cluster" / PARTIAL_ID  # a stage's files from peers
    partial.mkdir(parents=True)
    (partial / "config.json").write_text('{"model_type": "llama"}')
    running = start_node(data_dir=data, model=None)
    yield running
    running.stop()


def _transfer(state: str, **fields: Any) -> dict[str, Any]:
    counts = {"bytes_done": 0, "bytes_total": 0, "rate_bps": 0.0, "files_done": 0, "files_total": 0}
    base = {"manifest_id": "cd" * 32, "model": "big-model", "source": "peers", "state": state, "peers": 0}
    return base | counts | fields


def test_model_files_moving_show_per_node_with_rate(node: RunningNode) -> None:
    moving = _transfer(
        "fetching", bytes_done=4_200_000, bytes_total=10_500_000, rate_bps=2.1e6, peers=2, files_total=3
    )
    failed = _transfer("failed", model="other", source="hub", error="no peer holds the files")

    def with_transfers(route: Route) -> None:
        response = route.fetch()
        state = response.json()
        state["cluster"]["members"][0]["transfers"] = [failed, moving]
        route.fulfill(response=response, json=state)

    with chromium() as browser:
        page, console = open_page(browser, "about:blank")
        page.context.route("**/v1/cluster/events", lambda route: route.abort())  # poll the state instead
        page.context.route("**/v1/dashboard/state", with_transfers)
        page.goto(node.base_url + "/")
        row = page.locator(f"#transfer-rows tr[data-state=fetching][data-node='{node.node_id}']")
        row.wait_for()
        text = row.inner_text()
        assert "big-model" in text and "40% · 4.2 MB / 10.5 MB" in text and "files 0/3" in text, text
        assert "2.1 MB/s" in text and "peers (2)" in text, text
        rows = page.locator("#transfer-rows tr")
        assert rows.count() == 2 and rows.nth(1).get_attribute("data-state") == "failed"  # moving first
        assert "no peer holds the files" in rows.nth(1).inner_text()

        page.wait_for_selector("#model-rows tr[data-model='tiny-llama']")
        names = page.locator("#model-rows tr").evaluate_all("rows => rows.map(r => r.dataset.model)")
        assert names == ["tiny-llama"]  # not cluster/<id>: a partial copy cannot be placed by name
        assert [e for e in console.errors if "/v1/cluster/events" not in e] == []  # but the one we cut
