"""`shoal status`: ask any node for its picture of the cluster and show it as a table (or JSON)."""

from __future__ import annotations

import json
import time

import httpx
from pydantic import ValidationError
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from protocol.cluster_view import ClusterView, MemberView

DEFAULT_API = "http://127.0.0.1:52415"
_STATUS_STYLE = {"unknown": "dim", "alive": "green", "suspect": "yellow", "dead": "red", "left": "dim"}


class StatusError(Exception):
    """No usable answer from the node: the message says what to check."""


def fetch_cluster(api: str, timeout: float = 5.0) -> ClusterView:
    url = f"{api.rstrip('/')}/v1/cluster"
    try:
        response = httpx.get(url, timeout=timeout)
    except httpx.HTTPError as exc:
        raise StatusError(f"no Shoal node answers at {api} ({exc}); is `shoal run` running there?") from exc
    if response.status_code != 200:
        raise StatusError(f"{url} answered HTTP {response.status_code}: {response.text[:200]}")
    try:
        return ClusterView.model_validate(response.json())
    except (ValueError, ValidationError) as exc:
        raise StatusError(f"{url} did not answer with a Shoal cluster view: {exc}") from exc


def _gb(n: int) -> str:
    return f"{n / 2**30:.1f}"


def _member_row(member: MemberView, self_id: str) -> list[Text | str]:
    name = member.id[-8:] + (" (this)" if member.id == self_id else "")
    used = member.memory_total - member.memory_available
    seen = "now" if member.last_seen_s is None else f"{member.last_seen_s:.1f}s ago"
    return [
        name,
        member.host,
        Text(member.role, style="bold" if member.role == "leader" else ""),
        Text(member.status, style=_STATUS_STYLE[member.status]),
        f"{_gb(used)} / {_gb(member.memory_total)} GiB",
        member.backend,
        seen,
    ]


def render(view: ClusterView) -> Group:
    members = Table(
        title=f"cluster {view.cluster!r}: leader {(view.leader or 'none')[-8:]}, term {view.term}"
    )
    for column in ("node", "host", "role", "status", "memory used", "backend", "last seen"):
        members.add_column(column)
    for member in view.members:
        members.add_row(*_member_row(member, view.self))
    instances = Table(title="instances")
    for column in ("id", "model", "stages (node: layers)"):
        instances.add_column(column)
    for instance in view.instances:
        stages = ", ".join(f"{s.node_id[-8:]}: {s.start_layer}-{s.end_layer}" for s in instance.stages)
        instances.add_row(instance.id, instance.model, stages)
    if not view.instances:
        instances.add_row("-", "none", "")
    return Group(members, instances)


def show_status(api: str, *, as_json: bool, watch: bool, interval: float = 1.0) -> None:
    """Print the cluster once, or refresh it in place until Ctrl-C with `watch`."""
    console = Console()
    if as_json:
        print(json.dumps(fetch_cluster(api).model_dump(mode="json"), indent=2))
        return
    if not watch:
        console.print(render(fetch_cluster(api)))
        return
    with Live(render(fetch_cluster(api)), console=console, auto_refresh=False) as live:
        while True:
            time.sleep(interval)
            live.update(render(fetch_cluster(api)), refresh=True)
