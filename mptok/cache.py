"""A prefix-tokenization cache: tokenize each prompt's new tail, not its whole history.

In chat and agentic serving every prompt is the previous prompt of its
conversation plus a little, often with the chat template's generation prompt
rewritten. ``PrefixTokenCache`` keeps the ids of each conversation's last
prompt and tokenizes only from a proven seam near the point where the new
prompt departs from it (``mptok.seam``), so a 200k-token prompt costs about
what its last few hundred tokens cost. Whatever it returns equals
``tokenizer(text, add_special_tokens=False)["input_ids"]``.

It is also the point where routing plugs in: ``route`` may hand a prompt to
the frontend process that holds its conversation (``mptok.routing``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from mptok.backend import SlowTokenizerError, TokenizerBackend, TokenizerRefused, backend_for
from mptok.config import CacheConfig
from mptok.errors import RouteFailed
from mptok.prefix_index import PrefixIndex
from mptok.seam import CachedPrompt, extend_prompt, tokenize_prompt

logger = logging.getLogger(__name__)

Route = Callable[[str, str], "list[int] | None"]

class PrefixTokenCache:
    """Exact prefix-tokenization cache, safe to share between threads.

    ``encode`` returns a new list each call, equal to
    ``tokenizer(text, add_special_tokens=False)["input_ids"]`` for a
    transformers fast tokenizer or to ``tokenizer.encode(text,
    add_special_tokens=False).ids`` for a ``tokenizers.Tokenizer``.

    ``route``: None, or a callable ``(key, text) -> list[int] | None`` that
    may tokenize a keyed prompt elsewhere; returning None or raising
    ``RouteFailed`` makes the cache tokenize here. Only prompts the cache
    would keep, and that carry a key, are offered to it.
    """

    def __init__(self, config: CacheConfig | None = None):
        self.config = config if config is not None else CacheConfig.from_env()
        self.route: Route | None = None
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, CachedPrompt] = OrderedDict()
        self._cached_chars = 0
        self._by_content = PrefixIndex()
        self._anonymous = itertools.count()
        self._disabled = False
        self._warned_slow = False
        self._counts = dict.fromkeys(
            ("hits", "misses", "resync_failures", "uncached", "routed", "route_failures"), 0
        )

    # -- public API ---------------------------------------------------------

    def encode(self, tokenizer: Any, text: str, key: str | None = None) -> list[int]:
        """Token ids of ``text``; may ask ``route`` to tokenize it elsewhere.

        ``key`` names the conversation; without it, the longest kept prompt
        that ``text`` starts with is extended. Raises ``TypeError`` for text
        that is not a str, and whatever the tokenizer itself raises.
        """
        _check_input(text, key)
        route = self.route
        if route is not None and key is not None and self._keeps(text):
            routed = self._try_route(route, key, text)
            if routed is not None:
                return routed
        return self._encode_here(tokenizer, text, key)

    def encode_local(self, tokenizer: Any, text: str, key: str | None = None) -> list[int]:
        """Like ``encode``, but never routes: what an owner runs for its peers."""
        _check_input(text, key)
        return self._encode_here(tokenizer, text, key)

    def stats(self) -> dict[str, int]:
        """Counters since creation, and the current size of the cache."""
        with self._lock:
            return dict(
                self._counts,
                entries=len(self._entries),
                cached_chars=self._cached_chars,
                disabled=int(self._disabled),
            )

    def clear(self) -> None:
        """Forget every kept prompt (counters stay)."""
        with self._lock:
            self._entries.clear()
            self._by_content = PrefixIndex()
            self._cached_chars = 0

    # -- internals ----------------------------------------------------------

    def _keeps(self, text: str) -> bool:
        return (
            not self._disabled
            and self.config.min_chars <= len(text) <= self.config.max_cached_chars
            and len(text) > 0
        )

    def _try_route(self, route: Route, key: str, text: str) -> list[int] | None:
        try:
            ids = route(key, text)
        except RouteFailed as e:
            logger.debug("route for %r failed: %s", key, e)
            self._count("route_failures")
            return None
        except Exception:
            logger.warning("route hook raised; tokenizing locally", exc_info=True)
            self._count("route_failures")
            return None
        if ids is None:
            return None
        self._count("routed")
        return ids

    def _encode_here(self, tokenizer: Any, text: str, key: str | None) -> list[int]:
        if not text:
            return []
        try:
            backend = backend_for(tokenizer)
        except SlowTokenizerError as e:
            self._warn_slow(tokenizer, e)
            return _call_tokenizer(tokenizer, text)
        if not self._keeps(text):
            self._count("uncached")
            return self._encode_full(backend, tokenizer, text)
        try:
            return self._encode_cached(backend, tokenizer, text, key)
        except TokenizerRefused:
            # Exactly what the tokenizer itself does with this text: its ids
            # or its error. Nothing is kept.
            return _call_tokenizer(tokenizer, text)
        except Exception:
            self._disable()
            return self._encode_full(backend, tokenizer, text)

    def _encode_cached(
        self, backend: TokenizerBackend, tokenizer: Any, text: str, key: str | None
    ) -> list[int]:
        holder: Hashable = (backend.serial, key) if key is not None else None
        with self._lock:
            if key is None:
                holder = self._by_content.longest_prefix_of(text)
                base = self._entries.get(holder) if holder is not None else None
                if base is None or holder[0] != backend.serial:
                    holder = (backend.serial, None, next(self._anonymous))
                    base = None
            else:
                base = self._entries.get(holder)
        config = self.config
        prompt = None
        if base is not None:
            prompt = extend_prompt(
                backend,
                base,
                text,
                window_tokens=config.seam_window_tokens,
                max_attempts=config.max_seam_attempts,
            )
            if prompt is None:
                self._count("resync_failures")
        if prompt is None:
            prompt = tokenize_prompt(backend, text, config.seam_window_tokens)
            self._count("misses")
        else:
            self._count("hits")
        self._keep(holder, prompt, by_content=key is None)
        return prompt.ids.to_list()

    def _keep(self, holder: Hashable, prompt: CachedPrompt, *, by_content: bool) -> None:
        with self._lock:
            old = self._entries.pop(holder, None)
            if old is not None:
                self._cached_chars -= len(old.text)
            self._entries[holder] = prompt
            self._cached_chars += len(prompt.text)
            if by_content:
                self._by_content.add(holder, prompt.text)
            while (
                len(self._entries) > self.config.max_entries
                or self._cached_chars > self.config.max_cached_chars
            ):
                evicted_holder, evicted = self._entries.popitem(last=False)
                self._cached_chars -= len(evicted.text)
                self._by_content.discard(evicted_holder)

    def _encode_full(self, backend: TokenizerBackend, tokenizer: Any, text: str) -> list[int]:
        try:
            return backend.encode(text).ids
        except TokenizerRefused:
            return _call_tokenizer(tokenizer, text)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _disable(self) -> None:
        with self._lock:
            if self._disabled:
                return
            self._disabled = True
            self._entries.clear()
            self._by_content = PrefixIndex()
            self._cached_chars = 0
        logger.warning(
            "prefix token cache disabled after an internal error; tokenizing in full",
            exc_info=True,
        )

    def _warn_slow(self, tokenizer: Any, reason: SlowTokenizerError) -> None:
        if not self._warned_slow:
            self._warned_slow = True
            warnings.warn(
                f"mptok cannot cache for {type(tokenizer).__name__} ({reason}); "
                "it tokenizes every prompt in full with the tokenizer itself",
                stacklevel=4,
            )


def _check_input(text: object, key: object) -> None:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, not {type(text).__name__}")
    if key is not None and not isinstance(key, str):
        raise TypeError(f"key must be a str or None, not {type(key).__name__}")


def _call_tokenizer(tokenizer: Any, text: str) -> list[int]:
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encode(text, add_special_tokens=False).ids
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
