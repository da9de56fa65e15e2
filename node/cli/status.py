"""`shoal status`: ask any node for its picture of the cluster and show it as a table (or JSON)."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from protocol.cluster_view import ClusterView, LoadView, MemberView

DEFAULT_API = "http://127.0.0.1:52415"
_STATUS_STYLE = {"unknown": "dim", "alive": "green", "suspect": "yellow", "dead": "red", "left": "dim"}
_TRANSFER_STYLE = {"fetching": "yellow", "done": "green", "failed": "red"}


class StatusError(Exception):
    """No usable answer from the node: the message says what to check."""


V = TypeVar("V", bound=BaseModel)


def get_view(api: str, path: str, view: type[V], api_key: str | None = None, timeout: float = 5.0) -> V:
    """`GET api + path` parsed as `view`; a `StatusError` that says what to check otherwise."""
    url = f"{api.rstrip('/')}{path}"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise StatusError(f"no Shoal node answers at {api} ({exc}); is `shoal run` running there?") from exc
    if response.status_code == 401:
        hint = "that API key is wrong" if api_key else "it needs an API key: --api-key or $SHOAL_API_KEY"
        raise StatusError(f"{api} refused the request: {hint}")
    if response.status_code != 200:
        raise StatusError(f"{url} answered HTTP {response.status_code}: {response.text[:200]}")
    try:
        return view.model_validate(response.json())
    except (ValueError, ValidationError) as exc:
        raise StatusError(f"{url} did not answer as a Shoal node does: {exc}") from exc


def fetch_cluster(api: str, api_key: str | None = None, timeout: float = 5.0) -> ClusterView:
    return get_view(api, "/v1/cluster", ClusterView, api_key, timeout)


def _gb(n: int) -> str:
    return f"{n / 2**30:.1f}"


def _round_trip(us: int | None) -> str:
    if us is None:
        return "-"
    return f"{us} us" if us < 1000 else f"{us / 1000:.1f} ms"


def _member_row(member: MemberView, self_id: str, trips: dict[str, int]) -> list[Text | str]:
    """`trips`: the round trips the answering node measured to the others."""
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
        _round_trip(trips.get(member.id)),
    ]


def render(view: ClusterView) -> Group:
    members = Table(
        title=f"cluster {view.cluster!r}: leader {(view.leader or 'none')[-8:]}, term {view.term}"
    )
    for column in ("node", "host", "role", "status", "memory used", "backend", "last seen", "round trip"):
        members.add_column(column)
    me = next((m for m in view.members if m.id == view.self), None)
    trips = me.round_trips_us if me is not None else {}
    for member in view.members:
        members.add_row(*_member_row(member, view.self, trips))
    instances = Table(title="instances")
    for column in ("id", "model", "stages (node: layers)", "load"):
        instances.add_column(column)
    replicas = Counter(instance.model for instance in view.instances)
    for instance in view.instances:
        if instance.sharding == "tensor":  # every node holds a slice of every layer
            stages = "tensor: " + ", ".join(
                f"{s.node_id[-8:]}: rank {r}" for r, s in enumerate(instance.stages)
            )
        else:
            stages = ", ".join(f"{s.node_id[-8:]}: {s.start_layer}-{s.end_layer}" for s in instance.stages)
        if instance.state is not None:  # its files are moving, or their transfer failed
            stages += f" ({instance.state}{': ' + instance.error if instance.error else ''})"
        model = instance.model + (
            f" ({replicas[instance.model]} replicas)" if replicas[instance.model] > 1 else ""
        )
        instances.add_row(instance.id, model, stages, _load(instance.load))
    if not view.instances:
        instances.add_row("-", "none", "", "")
    transfers = _transfers(view)
    return Group(members, instances, *([transfers] if transfers is not None else []))


def _load(load: LoadView | None) -> Text:
    """An instance's load as its entry node reports it: ready or not, requests in it, served."""
    if load is None:
        return Text("?", style="dim")
    text = Text("ready" if load.ready else "not ready", style="green" if load.ready else "yellow")
    text.append(f", {load.active} active ({load.queued} queued), {load.served} served")
    return text


def _transfers(view: ClusterView) -> Table | None:
    """Model files moving to each node (and the latest finished moves); None when there are none."""
    rows = [(member.id, t) for member in view.members for t in member.transfers]
    if not rows:
        return None
    table = Table(title="model files")
    for column in ("node", "model", "from", "state", "done", "rate", "files"):
        table.add_column(column)
    for node, t in rows:
        total = f"{t.bytes_total / 1e6:.0f}" if t.bytes_total else "?"
        done = f"{t.fraction:.0%} ({t.bytes_done / 1e6:.0f} / {total} MB)"
        state = Text(t.state, style=_TRANSFER_STYLE[t.state])
        if t.error:
            state.append(f": {t.error}")
        rate = f"{t.rate_bps / 1e6:.1f} MB/s" if t.state == "fetching" else ""
        source = f"{t.source} ({t.peers})" if t.source == "peers" and t.state == "fetching" else t.source
        table.add_row(node[-8:], t.model, source, state, done, rate, f"{t.files_done}/{t.files_total}")
    return table


def show_status(
    api: str, *, api_key: str | None = None, as_json: bool, watch: bool, interval: float = 1.0
) -> None:
    """Print the cluster once, or refresh it in place until Ctrl-C with `watch`."""
    console = Console()
    if as_json:
        print(json.dumps(fetch_cluster(api, api_key).model_dump(mode="json"), indent=2))
        return
    if not watch:
        console.print(render(fetch_cluster(api, api_key)))
        return
    with Live(render(fetch_cluster(api, api_key)), console=console, auto_refresh=False) as live:
        while True:
            time.sleep(interval)
            live.update(render(fetch_cluster(api, api_key)), refresh=True)
