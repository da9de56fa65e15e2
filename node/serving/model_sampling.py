"""A served model's sampling defaults as this node can tell them, for its model cards (`/v1/models`).

The runner reads the model's `generation_config.json` where it loads the folder, and samples with
it. A node shows the same defaults for a model whose entry runs elsewhere too, when it can: the
instance's manifest says whether the model has a generation_config.json and its SHA-256, so
  - no such file in the manifest: the model recommends nothing (the server's defaults apply);
  - this node runs the entry, or holds a copy of that exact file anywhere in its data dir (the
    built-in model imported here, a folder in `models/`, the files of a stage it hosts under
    `models/cluster/`): its content, checked by hash, gives the defaults;
  - otherwise the card says nothing (None): only the nodes that hold the files can tell.

Content-addressed, so a found file is read once; a hash not found is looked for in the data dir
again after `RETRY_S` (files may arrive meanwhile), and in the entry runner's folder whenever this
node has one. `node.serving.model_cards` calls this off the event loop.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from node.models.generation_config import GENERATION_CONFIG, parse_sampling_defaults, read_sampling_defaults
from node.models.store import models_dir
from protocol.manifest import Manifest
from protocol.sampling import SamplingDefaults

RETRY_S = 10.0
"""How long a generation_config.json this node did not find is taken as absent before looking again."""
MAX_CONFIG_BYTES = 1024**2
"""A generation_config.json is a few hundred bytes; anything past this is not read."""


class ModelSampling:
    """`defaults(manifest, folder)`: the model's own sampling defaults, or None where unknown here."""

    def __init__(self, data_dir: Path, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._data_dir = data_dir
        self._clock = clock
        self._by_hash: dict[str, SamplingDefaults] = {}
        self._missing: dict[str, float] = {}
        """Hash -> when it was last looked for in vain."""
        self._by_folder: dict[Path, SamplingDefaults] = {}

    def defaults(self, manifest: Manifest | None, folder: Path | None) -> SamplingDefaults | None:
        """`folder`: where this node's runner loaded the model from, if it runs the entry."""
        if manifest is None:
            if folder is None:
                return None
            if folder not in self._by_folder:
                self._by_folder[folder] = read_sampling_defaults(folder)
            return self._by_folder[folder]
        entry = next((f for f in manifest.files if f.path == GENERATION_CONFIG), None)
        if entry is None:
            return SamplingDefaults()
        if (known := self._by_hash.get(entry.sha256)) is not None:
            return known
        now = self._clock()
        searched = now - self._missing.get(entry.sha256, -RETRY_S) < RETRY_S
        for path in self._candidates(folder, search=not searched):
            data = _small_file(path, entry.size)
            if data is not None and hashlib.sha256(data).hexdigest() == entry.sha256:
                found = self._by_hash[entry.sha256] = parse_sampling_defaults(data, origin=path)
                self._missing.pop(entry.sha256, None)
                return found
        if not searched:
            self._missing[entry.sha256] = now
        return None

    def _candidates(self, folder: Path | None, *, search: bool) -> Iterator[Path]:
        """The runner's folder always (one stat); the data dir's folders when `search`."""
        if folder is not None:
            yield folder / GENERATION_CONFIG
        if not search:
            return
        root = models_dir(self._data_dir)
        for pattern in (f"*/{GENERATION_CONFIG}", f"*/*/{GENERATION_CONFIG}"):
            yield from sorted(root.glob(pattern))


def _small_file(path: Path, size: int) -> bytes | None:
    """The file's bytes when it has `size` of them (a cheap first check), else None."""
    try:
        if size > MAX_CONFIG_BYTES or path.stat().st_size != size:
            return None
        return path.read_bytes()
    except OSError:
        return None
