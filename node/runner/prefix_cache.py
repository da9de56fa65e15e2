"""The runner's prefix cache: KV caches of earlier requests, found again by their tokens.

The next turn of a chat repeats the whole conversation so far; its KV cache is the previous turn's
(prompt plus answer) and only the new tokens need a prefill. This wraps mlx-lm's `LRUPromptCache`
(a token trie with LRU eviction, what `mlx_lm.server` uses) with the two rules that keep it exact:

- An entry's key is exactly the tokens whose keys and values the cache holds: prompt plus every
  generated token that went through the model. One token off and later requests silently get wrong
  output, so the runner stores only what mlx-lm's `BatchGenerator` reports as a sequence's tokens
  next to the cache it extracted for them.
- A hit always leaves at least one prompt token to run, because the first generated token comes from
  the logits of the prompt's last token: an exact hit is trimmed by one.

(The cached keys and values of generated tokens were computed by decode steps, those of a fresh
prompt by prefill chunks: the same values up to float32 rounding order. Greedy answers with and
without the cache were identical in every test and benchmark run.)

The budget is in tokens (what a user can reason about). It becomes a byte limit from the bytes per
token of the entries seen so far (every layer's keys and values), and whenever the entries exceed it,
the least recently stored go first (a request that used an entry stores its own, longer one when it
ends, which replaces the entry it extends). A budget of 0 disables the cache. Each hit deep-copies its
entry, so a request never writes into the cache of another. All of it runs on the runner's main thread.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

log = logging.getLogger("shoal.runner")

_MODEL = "model"
"""`LRUPromptCache` can hold several models' caches; a runner serves one."""
MAX_ENTRIES = 1 << 20
"""Entries are bounded by the token budget, not by their number."""


class PrefixCache:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max(0, max_tokens)
        self._cache = LRUPromptCache(max_size=MAX_ENTRIES)
        self._bytes_per_token = 0.0
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def __len__(self) -> int:
        return len(self._cache)

    @property
    def nbytes(self) -> int:
        return int(self._cache.nbytes)

    def fetch(self, prompt: Sequence[int]) -> tuple[list[Any] | None, int]:
        """A private copy of the longest cached prefix of `prompt` and its length; (None, 0) on a miss.

        The length is at most `len(prompt) - 1`: the caller runs the rest of the prompt on the copy.
        """
        if not self.enabled or len(prompt) < 2:
            return None, 0
        cache, rest = self._cache.fetch_nearest_cache(_MODEL, list(prompt))
        cached = len(prompt) - len(rest)
        if cache is not None and cached == len(prompt):
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                cached -= 1
            else:
                cache, cached = None, 0
        if cache is None or cached <= 0:
            self.misses += 1
            return None, 0
        self.hits += 1
        return cache, cached

    def insert(self, tokens: Sequence[int], cache: list[Any]) -> None:
        """Keep `cache`, which holds exactly the keys and values of `tokens`; evict to fit the budget.

        An entry that extends an older one replaces it (mlx-lm drops cached prefixes of a new key).
        """
        if not self.enabled or not tokens or len(tokens) > self.max_tokens:
            return
        nbytes = sum(c.nbytes for c in cache)
        self._bytes_per_token = max(self._bytes_per_token, nbytes / len(tokens))
        self._cache.insert_cache(_MODEL, list(tokens), cache)
        self._cache.trim_to(n_bytes=int(self.max_tokens * self._bytes_per_token))

    def stats(self) -> dict[str, int]:
        return {"entries": len(self), "bytes": self.nbytes, "hits": self.hits, "misses": self.misses}
