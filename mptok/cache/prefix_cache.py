"""A prefix-tokenization cache: tokenize each prompt's new tail, not its whole history.

In chat and agentic serving every prompt is the previous prompt of its
conversation plus a little, often with the chat template's generation prompt
rewritten. ``PrefixTokenCache`` keeps the ids of each conversation's last
prompt (int32 arrays, ``mptok.core.ids``) and tokenizes only from a proven
seam near the point where the new prompt departs from it
(``mptok.cache.seam``), so a 200k-token prompt costs about what its last few
hundred tokens cost. It only ever tokenizes here. A prompt kept under a
conversation key also keeps the fingerprint chain of its text
(``mptok.core.protocol``), so that routing, a layer above, can name it by
the fingerprint of its first characters (``keep``).
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mptok.cache.backend import SlowTokenizerError, TokenizerBackend, backend_for, backend_stats
from mptok.cache.config import CacheConfig, check_key
from mptok.cache.prefix_index import PrefixIndex
from mptok.cache.protocols import Kept
from mptok.cache.seam import CachedPrompt, extend_prompt, prompt_of_ids, tokenize_prompt
from mptok.core.counting import Counters
from mptok.core.protocol import BLOCK_CHARS, DIGEST_BYTES, Fingerprint, extend_chain
from mptok.core.ids import as_id_array, common_prefix_length, held_bytes
from mptok.engines.choice import TokenizerRefused

logger = logging.getLogger(__name__)

# Prompts kept under one conversation key. Two conversations may share a key
# (one derived from their identical first messages, ``mptok.api.affinity``; a
# client that reuses a session id; a regenerated answer): each keeps a branch
# of its own, and a prompt extends the branch it shares the most with,
# instead of the conversations evicting each other turn after turn.
MAX_BRANCHES = 4
# A prompt that parts from the branch it extends within this many characters
# of the end of either replaces that branch (a chat template rewrites its
# generation prompt, a few characters, every turn; a client resends an
# earlier turn); one that parts earlier starts a branch of its own.
BRANCH_SLACK_CHARS = 256

# What an entry costs beyond its text, ids and fingerprint chain (counted by
# size): its objects, the holder, the slots of the LRU dict and content index.
# Measured with tracemalloc (scripts/bench_memory.py) and rounded up.
ENTRY_OVERHEAD_BYTES = 1024


@dataclass(frozen=True)
class _Entry:
    """A kept prompt, the fingerprint chain of its text (empty
    for a prompt kept without a key: no peer asks for those), and
    ``nbytes``, what it all costs (``entry_bytes``)."""

    prompt: CachedPrompt
    chain: bytes
    nbytes: int


def entry_bytes(holder: Hashable, prompt: CachedPrompt, chain: bytes) -> int:
    """Bytes a kept prompt holds: its key, text, the id buffer it pins (spare
    room included), fingerprint chain and bookkeeping."""
    return held_bytes(holder, prompt.text, prompt.ids) + sys.getsizeof(chain) + ENTRY_OVERHEAD_BYTES


# A kept prompt that a new one extends: its holder, its entry, and the
# characters they share. A holder is (backend serial, key, branch) for a
# prompt of a conversation, (backend serial, None, n) for a keyless prompt,
# which is filed by content instead.
_Extension = tuple[Hashable, "_Entry | None", int]


class PrefixTokenCache:
    """Exact prefix-tokenization cache, safe to share between threads.

    ``encode`` returns a new list each call, equal to
    ``tokenizer(text, add_special_tokens=False)["input_ids"]`` for a
    transformers fast tokenizer or to ``tokenizer.encode(text,
    add_special_tokens=False).ids`` for a ``tokenizers.Tokenizer``;
    ``encode_array`` the same ids as a read-only int32 numpy array, without
    building a list (for a caller that writes JSON or sends ids on).
    """

    def __init__(self, config: CacheConfig | None = None):
        self.config = config if config is not None else CacheConfig.from_env()
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        # (backend serial, key) -> the holders of that key's branches, oldest first.
        self._branches: dict[tuple[int, str], list[Hashable]] = {}
        self._branch_ids = itertools.count(1)
        self._cached_chars = 0
        self._cached_bytes = 0
        self._by_content = PrefixIndex()
        self._anonymous = itertools.count()
        self._disabled = False
        self._warned_slow = False
        self._last_backend: tuple[Any, TokenizerBackend] | None = None
        self._counters = Counters(
            ("hits", "misses", "resync_failures", "uncached", "allocation_failures", "tokens_reused", "tokens_tokenized")
        )

    def encode(self, tokenizer: Any, text: str, key: str | None = None) -> list[int]:
        """Token ids of ``text``, tokenized here.

        ``key`` names the conversation; without it, the longest kept prompt
        that ``text`` starts with is extended. Raises ``TypeError`` for text
        that is not a str, ``ValueError`` for a key longer than
        ``mptok.cache.config.MAX_KEY_BYTES`` (256 UTF-8 bytes), and whatever the
        tokenizer itself raises.
        """
        _check_input(text, key)
        if not text:
            return []
        entry = self._entry_or_ids(tokenizer, text, key)
        return entry.prompt.ids.to_list() if isinstance(entry, _Entry) else entry

    def encode_array(self, tokenizer: Any, text: str, key: str | None = None) -> np.ndarray:
        """``encode``'s ids as a 1-D int32 numpy array, read-only when it is
        the cache's own (it never changes); no list and no Python int is
        made for them. Raises what ``encode`` raises."""
        _check_input(text, key)
        entry = self._entry_or_ids(tokenizer, text, key) if text else []
        return entry.prompt.ids.array() if isinstance(entry, _Entry) else as_id_array(entry)

    def keep(
        self,
        tokenizer: Any,
        text: str,
        key: str,
        *,
        after: Fingerprint | None = None,
        ids: np.ndarray | None = None,
        chain: bytes = b"",
        if_kept: bool = False,
        room_only: bool = False,
    ) -> Kept | None:
        """Make ``text`` conversation ``key``'s latest kept prompt, and give all its ids.

        As ``encode_array`` does, it extends the kept prompt of ``key`` that
        ``text`` shares the most with, tokenizing here from a proven seam.
        With ``after``, ``text`` is what follows the first ``after.chars``
        characters of a kept prompt of ``key`` whose fingerprint chain has
        ``after`` (``mptok.core.protocol``): None when none has (a wrong
        or stale fingerprint, an evicted conversation, a tokenizer the cache
        cannot serve). With ``ids``, the exact ids of ``text`` known from
        elsewhere, nothing is tokenized: they are kept as they are
        (``chain``: digests of ``text``'s first blocks computed already,
        continued instead of hashed again). With ``if_kept`` it does this
        only where a prompt of ``key`` is kept here: None otherwise. With
        ``room_only`` the prompt is kept only where that evicts no other
        prompt (what ``key`` kept stays otherwise). Raises what ``encode``
        raises for bad input.
        """
        _check_input(text, key)
        if key is None:
            raise TypeError("key must be a str: keep names a conversation")
        if after is None and ids is None and not if_kept:
            return _kept(self._entry_or_ids(tokenizer, text, key, room_only=room_only) if text else [])
        try:
            backend = self._backend(tokenizer)
        except SlowTokenizerError:
            return None if ids is None else Kept(as_id_array(ids), False)
        extending = None
        if after is not None:
            found = self._extension_after(backend, key, after, text)
            if found is None:
                return None
            extending, text = found
        elif ids is not None:
            ids = as_id_array(ids)
            if not self._keeps(text):
                return Kept(ids, False)
            holder, known, shared = self._branch_for(backend, key, text)
            reused = max(chain, _shared_digests(known, shared), key=len)
            entry = _new_entry(holder, prompt_of_ids(text, ids), key, reused)
            return Kept(ids, self._keep(holder, entry, room_only=room_only))
        else:
            with self._lock:
                if (backend.serial, key) not in self._branches:
                    return None
        return _kept(self._entry_or_ids(tokenizer, text, key, extending, room_only=room_only))

    def _extension_after(
        self, backend: TokenizerBackend, key: str, after: Fingerprint, tail: str
    ) -> tuple[_Extension, str] | None:
        """The kept prompt of ``key`` whose chain has ``after`` (the newest
        such branch), how the prompt it continues with ``tail`` extends it,
        and that prompt's text; None when no kept prompt has ``after``."""
        with self._lock:
            found = next(
                ((holder, entry) for holder, entry in self._branches_of(backend.serial, key) if after.matches(entry.chain)),
                None,
            )
        if found is None:
            return None
        holder, known = found
        kept_text, shared_chars = known.prompt.text, after.chars
        shared = shared_chars + common_prefix_length(kept_text[shared_chars:], tail)
        text = kept_text if shared == len(kept_text) == shared_chars + len(tail) else kept_text[:shared_chars] + tail
        return (self._branch_holder(backend, key, holder, known, shared, text), known, shared), text

    def stats(self) -> dict[str, float]:
        """Counters since creation, and the current size of the cache.

        ``cached_bytes`` is everything the kept conversations hold, never
        more than ``max_bytes``. ``allocation_failures`` counts
        ``MemoryError``s while caching (each emptied the cache).
        ``tokens_reused`` counts the ids answered from kept prompts,
        ``tokens_tokenized`` those the backend tokenized: their ratio is what
        the cache saved. ``backend_*``: ``mptok.cache.backend.backend_stats``.
        """
        backends = backend_stats()
        with self._lock:
            return dict(
                self._counters.snapshot(),
                **backends,
                entries=len(self._entries),
                cached_chars=self._cached_chars,
                cached_bytes=self._cached_bytes,
                max_bytes=self.config.max_bytes,
                disabled=int(self._disabled),
            )

    def clear(self) -> None:
        """Forget every kept prompt (counters stay)."""
        with self._lock:
            self._forget_all()

    def _keeps(self, text: str) -> bool:
        config = self.config
        return (
            not self._disabled
            and config.min_chars <= len(text) < config.max_bytes  # a text costs at least a byte a character
            and len(text) > 0
        )

    def _backend(self, tokenizer: Any) -> TokenizerBackend:
        """``backend_for`` ``tokenizer`` and this cache's choice, remembered for the last tokenizer
        (a frontend has one: the process-wide table and its lock are not asked per prompt)."""
        last = self._last_backend
        if last is not None and last[0] is tokenizer:
            return last[1]
        backend = backend_for(tokenizer, self.config.tokenizer_backend)
        self._last_backend = (tokenizer, backend)
        return backend

    def _entry_or_ids(
        self, tokenizer: Any, text: str, key: str | None, extending: _Extension | None = None, *, room_only: bool = False
    ) -> _Entry | list[int]:
        """The entry for ``text``, made here (extending the kept prompt
        ``extending`` names, if given) and kept (with ``room_only``, only if
        that evicts nothing), or its ids if it cannot be kept."""
        try:
            backend = self._backend(tokenizer)
        except SlowTokenizerError as e:
            self._warn_slow(tokenizer, e)
            return _call_tokenizer(tokenizer, text)
        try:
            entry = self._entry_here(backend, text, key, extending, room_only)
        except TokenizerRefused:
            # Exactly what the tokenizer itself does with this text: its ids
            # or its error. Nothing is kept.
            return _call_tokenizer(tokenizer, text)
        if entry is None:
            return self._encode_full(backend, tokenizer, text)
        return entry

    def _entry_here(
        self, backend: TokenizerBackend, text: str, key: str | None, extending: _Extension | None, room_only: bool
    ) -> _Entry | None:
        """The entry kept for ``text``, made here; None if the text is not kept.

        Raises ``TokenizerRefused`` for text the Rust tokenizer refuses.
        """
        if not self._keeps(text):
            self._counters.add("uncached")
            return None
        try:
            return self._encode_cached(backend, text, key, extending, room_only)
        except TokenizerRefused:
            raise
        except MemoryError:
            # Memory is short: give back what the cache holds and tokenize
            # in full; the cache fills again from the next prompt on.
            with self._lock:
                self._counters.add("allocation_failures")
                self._forget_all()
            logger.warning("out of memory while caching a prompt; cache emptied, tokenizing in full")
            return None
        except Exception:
            self._disable()
            return None

    def _encode_cached(
        self, backend: TokenizerBackend, text: str, key: str | None, extending: _Extension | None, room_only: bool
    ) -> _Entry:
        if extending is not None:
            holder, known, shared = extending
        elif key is None:
            holder, known, shared = self._kept_by_content(backend, text)
        else:
            holder, known, shared = self._branch_for(backend, key, text)
        config = self.config
        if known is not None and shared == len(text) == len(known.prompt.text):
            # The kept prompt again: it stays as it is, only its place in the LRU moves.
            with self._lock:
                if self._entries.get(holder) is known:
                    self._entries.move_to_end(holder)
                    self._counters.add("hits")
                    self._counters.add("tokens_reused", known.prompt.ids.length)
                    return known
        prompt = None
        if known is not None:
            prompt = extend_prompt(backend, known.prompt, text, shared, max_attempts=config.max_seam_attempts)
            if prompt is None:
                self._counters.add("resync_failures")
            else:
                # Sampled against a full tokenization, paid for by the characters tokenized.
                backend.check_splice(text, prompt.ids, len(text) - shared)
        if prompt is None:
            prompt = tokenize_prompt(backend, text)
            self._counters.add("misses")
        else:
            self._counters.add("hits")
        self._counters.add("tokens_reused", prompt.reused)
        self._counters.add("tokens_tokenized", prompt.ids.length - prompt.reused)
        entry = _new_entry(holder, prompt, key, _shared_digests(known, shared))
        self._keep(holder, entry, room_only=room_only)
        return entry

    def _kept_by_content(self, backend: TokenizerBackend, text: str) -> tuple[Hashable, _Entry | None, int]:
        """For a keyless prompt: the holder to keep it under, the kept prompt
        it extends (the longest one it starts with) and their shared length."""
        with self._lock:
            holder = self._by_content.longest_prefix_of(text)
            known = self._entries.get(holder) if holder is not None else None
        if known is None or holder[0] != backend.serial:
            return (backend.serial, None, next(self._anonymous)), None, 0
        return holder, known, len(known.prompt.text)

    def _branch_for(self, backend: TokenizerBackend, key: str, text: str) -> tuple[Hashable, _Entry | None, int]:
        """For a prompt of conversation ``key``: the holder to keep it under,
        the kept branch it extends (the one it shares the most characters
        with) and their shared length. It starts a new branch when the two
        share more than ``BRANCH_SLACK_CHARS`` characters and part ways more
        than that before the end of either; else it replaces that branch (a
        prompt sharing next to nothing restarts the conversation)."""
        with self._lock:
            holders = list(self._branches.get((backend.serial, key), ()))
            candidates = [(holder, self._entries[holder]) for holder in holders]
        best: tuple[Hashable, _Entry | None, int] = (None, None, -1)
        for holder, entry in candidates:
            shared = common_prefix_length(entry.prompt.text, text)
            if shared > best[2]:
                best = (holder, entry, shared)
        holder, known, shared = best
        shared = max(shared, 0)
        return self._branch_holder(backend, key, holder, known, shared, text), known, shared

    def _branch_holder(
        self, backend: TokenizerBackend, key: str, holder: Hashable, known: _Entry | None, shared: int, text: str
    ) -> Hashable:
        """Where a prompt of ``key`` that extends branch ``holder`` (``known``)
        by ``shared`` characters is kept (see ``_branch_for``)."""
        if known is None:
            # The first branch has a fixed holder, so that threads starting
            # one conversation at once keep one branch, not one each.
            return (backend.serial, key, 0)
        if BRANCH_SLACK_CHARS <= shared < min(len(known.prompt.text), len(text)) - BRANCH_SLACK_CHARS:
            return (backend.serial, key, next(self._branch_ids))
        return holder

    def _branches_of(self, serial: int, key: str) -> list[tuple[Hashable, _Entry]]:
        """The kept branches of ``key``, newest first; the caller holds the lock."""
        return [(holder, self._entries[holder]) for holder in reversed(self._branches.get((serial, key), ()))]

    def _keep(self, holder: Hashable, entry: _Entry, *, room_only: bool) -> bool:
        """Keep ``entry`` as the newest, then evict the least recently used
        until every limit holds; an entry over the byte budget by itself is
        not kept (and what ``holder`` had is forgotten). With ``room_only``
        it is kept only where it fits without evicting another entry, and
        otherwise what ``holder`` had stays. Returns whether it was kept."""
        config = self.config
        with self._lock:
            if room_only and not self._fits(holder, entry):
                return False
            self._drop(holder)
            if entry.nbytes > config.max_bytes:
                return False
            self._entries[holder] = entry
            self._cached_chars += len(entry.prompt.text)
            self._cached_bytes += entry.nbytes
            if holder[1] is None:
                self._by_content.add(holder, entry.prompt.text)
            else:
                branches = self._branches.setdefault(holder[:2], [])
                branches.append(holder)
                if len(branches) > MAX_BRANCHES:
                    self._drop(branches[0])
            self._evict_over_limits()
            return self._entries.get(holder) is entry

    def _evict_over_limits(self) -> None:
        """Drop the least recently used until every limit holds; the caller holds the lock."""
        config = self.config
        while len(self._entries) > config.max_entries or self._cached_bytes > config.max_bytes:
            self._drop(next(iter(self._entries)))

    def _fits(self, holder: Hashable, entry: _Entry) -> bool:
        """Whether ``entry`` in place of what ``holder`` keeps (if anything)
        stays within every limit; the caller holds the lock."""
        config, old = self.config, self._entries.get(holder)
        entries = len(self._entries) + (old is None)
        nbytes = self._cached_bytes + entry.nbytes - (old.nbytes if old is not None else 0)
        return entries <= config.max_entries and nbytes <= config.max_bytes

    def _drop(self, holder: Hashable) -> None:
        """Forget what ``holder`` has kept, if anything; the caller holds the lock."""
        old = self._entries.pop(holder, None)
        if old is None:
            return
        self._cached_chars -= len(old.prompt.text)
        self._cached_bytes -= old.nbytes
        if holder[1] is None:
            self._by_content.discard(holder)
        elif holder in (branches := self._branches.get(holder[:2], [])):
            branches.remove(holder)
            if not branches:
                del self._branches[holder[:2]]

    def _encode_full(self, backend: TokenizerBackend, tokenizer: Any, text: str) -> list[int]:
        try:
            ids = backend.encode_ids(text)
        except TokenizerRefused:
            return _call_tokenizer(tokenizer, text)
        self._counters.add("tokens_tokenized", len(ids))
        return ids

    def _forget_all(self) -> None:
        """Drop every kept prompt; the caller holds the lock."""
        self._entries.clear()
        self._branches.clear()
        self._by_content = PrefixIndex()
        self._cached_chars = 0
        self._cached_bytes = 0

    def _disable(self) -> None:
        with self._lock:
            if self._disabled:
                return
            self._disabled = True
            self._forget_all()
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
                stacklevel=5,
            )


def _shared_digests(known: _Entry | None, shared: int) -> bytes:
    """``known``'s digests of the blocks within its first ``shared`` characters."""
    return known.chain[: shared // BLOCK_CHARS * DIGEST_BYTES] if known is not None else b""


def _new_entry(holder: Hashable, prompt: CachedPrompt, key: str | None, reused: bytes) -> _Entry:
    """The entry that keeps ``prompt`` under ``holder``: with the fingerprint
    chain of its text if it has a ``key`` (peers ask for keyed prompts
    only), continuing ``reused``, digests of its text's first blocks."""
    chain = extend_chain(prompt.text, reused) if key is not None else b""
    return _Entry(prompt, chain, entry_bytes(holder, prompt, chain))


def _kept(entry: _Entry | list[int]) -> Kept:
    """The ids of the prompt kept as ``entry``, or of one not kept."""
    if isinstance(entry, _Entry):
        return Kept(entry.prompt.ids.array(), True)
    return Kept(as_id_array(entry), False)


def _check_input(text: object, key: object) -> None:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, not {type(text).__name__}")
    if key is not None:
        if not isinstance(key, str):
            raise TypeError(f"key must be a str or None, not {type(key).__name__}")
        check_key(key)


def _call_tokenizer(tokenizer: Any, text: str) -> list[int]:
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encode(text, add_special_tokens=False).ids
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
