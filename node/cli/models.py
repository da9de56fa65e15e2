"""`shoal models`: the model files each node of the cluster holds, asked of any node; or, with
`--local`, the models in this machine's data dir (no node needed)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from node.cli.status import get_view
from node.models import list_local_models
from protocol.held_models import ClusterModelsView, HeldModelView

MODELS_PATH = "/v1/cluster/models"


def _mb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:.0f}"


def _held(model: HeldModelView) -> str:
    """`12 / 40 MB (30%)`, or the file count alone when the sizes are not known."""
    if model.bytes_held is None or model.bytes_total is None:
        return "all files" if model.files_held is None else f"{model.files_held} file(s)"
    share = f" ({model.bytes_held / model.bytes_total:.0%})" if model.bytes_total else ""
    return f"{_mb(model.bytes_held)} / {_mb(model.bytes_total)} MB{share}"


def render(view: ClusterModelsView) -> Table:
    table = Table(title="model files on each node")
    for column in ("node", "host", "model", "manifest", "files", "held", "in use by"):
        table.add_column(column)
    for node in view.nodes:
        name = node.node[-8:] + (" (this)" if node.node == view.self else "")
        if not node.models:
            table.add_row(name, node.host, Text("none", style="dim"), "", "", "", "")
        for model in node.models:
            files = "?" if model.files_total is None else f"{model.files_held}/{model.files_total}"
            table.add_row(
                name,
                node.host,
                model.model or Text("?", style="dim"),
                model.manifest_id[:12],
                files,
                _held(model),
                ", ".join(model.in_use) or Text("-", style="dim"),
            )
    return table


def show_cluster_models(api: str, *, api_key: str | None, as_json: bool) -> None:
    view = get_view(api, MODELS_PATH, ClusterModelsView, api_key)
    if as_json:
        print(json.dumps(view.model_dump(mode="json"), indent=2))
    else:
        Console().print(render(view))


def show_local_models(data_dir: Path, *, as_json: bool) -> None:
    """The models in `data_dir` (what this machine can place by name), without asking a node."""
    models = list_local_models(data_dir)
    if as_json:
        fields = ("name", "model_type", "size_bytes")
        rows = [{**{f: getattr(m, f) for f in fields}, "path": str(m.path)} for m in models]
        print(json.dumps(rows, indent=2))
        return
    if not models:
        print(f"no models in {data_dir / 'models'} (run `shoal run` to prepare the built-in one)")
        return
    table = Table(title=f"models in {data_dir}")
    for column in ("name", "type", "size", "path"):
        table.add_column(column)
    for model in models:
        table.add_row(model.name, model.model_type, f"{model.size_bytes / 1e6:.0f} MB", str(model.path))
    Console().print(table)
