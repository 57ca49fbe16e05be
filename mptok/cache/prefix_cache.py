"""A prefix-tokenization cache: tokenize each prompt's new tail, not its whole history.

In chat and agentic serving every prompt is the previous prompt of its
conversation plus a little. ``PrefixTokenCache`` tokenizes only from a
proven seam near where a new prompt departs from a kept one (the seam
encoder, ``mptok.cache.seam``), so a 200k-token prompt costs about what its
last few hundred tokens cost; its store, ``KeptPrompts``, keeps each
conversation's last prompt, its ids (``mptok.core.ids``) and, under a key,
the fingerprint chain of its text (``mptok.core.protocol``), by which
routing names it (``extend_after``). It only ever tokenizes here.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from mptok.cache.backend import SlowTokenizerError, TokenizerBackend, backend_for, backend_stats
from mptok.cache.config import MAX_KEY_BYTES, CacheConfig, check_key
from mptok.cache.protocols import Kept
from mptok.cache.seam import CachedPrompt, extend_prompt
from mptok.core.counting import Counters
from mptok.core.ids import IdPieces, as_id_array, common_prefix_length, held_bytes
from mptok.core.protocol import BLOCK_CHARS, DIGEST_BYTES, Fingerprint, extend_chain
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


INDEX_BLOCK_CHARS = 4096

# Characters of each block that go into its fingerprint. The chain is only a
# filter (startswith confirms), so sampling the end of each block keeps the
# cost per block constant instead of hashing the whole text every request.
INDEX_SAMPLE_CHARS = 64


def _fingerprints(text: str, blocks: int) -> Iterator[int]:
    """Fingerprints of ``text``'s first 0, 1, ..., ``blocks`` full blocks."""
    chain = hash(("mptok", 0))
    yield chain
    for block in range(1, blocks + 1):
        end = block * INDEX_BLOCK_CHARS
        chain = hash((chain, text[end - INDEX_SAMPLE_CHARS : end]))
        yield chain


class PrefixIndex:
    """Finds the longest kept prompt that a keyless prompt starts with, without a scan.

    Comparing against every kept prompt would cost O(entries x length) per
    request, so each prompt is filed under a fingerprint of its first ``n``
    blocks of ``INDEX_BLOCK_CHARS`` characters, chained block by block. A
    lookup computes the same chain over the new prompt and visits one bucket
    per block boundary, deepest first; every candidate is confirmed with
    ``str.startswith``, so a fingerprint collision costs a compare, never a
    wrong answer. Not thread-safe: the store calls it under its own lock.
    """

    def __init__(self) -> None:
        self._buckets: dict[tuple[int, int], dict[Hashable, str]] = {}
        self._filed: dict[Hashable, tuple[int, int]] = {}

    def add(self, holder: Hashable, text: str) -> None:
        """File ``text`` for ``holder``, replacing what ``holder`` had filed."""
        self.discard(holder)
        blocks = len(text) // INDEX_BLOCK_CHARS
        *_, fingerprint = _fingerprints(text, blocks)
        bucket_key = (blocks, fingerprint)
        self._buckets.setdefault(bucket_key, {})[holder] = text
        self._filed[holder] = bucket_key

    def discard(self, holder: Hashable) -> None:
        bucket_key = self._filed.pop(holder, None)
        if bucket_key is None:
            return
        bucket = self._buckets[bucket_key]
        del bucket[holder]
        if not bucket:
            del self._buckets[bucket_key]

    def longest_prefix_of(self, text: str) -> Hashable | None:
        """The holder of the longest filed text that ``text`` starts with."""
        blocks = len(text) // INDEX_BLOCK_CHARS
        chain = list(_fingerprints(text, blocks))
        for depth in range(blocks, -1, -1):
            bucket = self._buckets.get((depth, chain[depth]), {})
            matches = [h for h, filed in bucket.items() if text.startswith(filed)]
            if matches:
                return max(matches, key=lambda h: len(bucket[h]))
        return None

    def __len__(self) -> int:
        return len(self._filed)


class KeptPrompts:
    """A cache's store: the kept prompts under their holders, least recently
    used evicted beyond ``config``'s entries and bytes. Thread-safe; it
    tokenizes nothing."""

    def __init__(self, config: CacheConfig):
        self._config = config
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        # (backend serial, key) -> the holders of that key's branches, oldest first.
        self._branches: dict[tuple[int, str], list[Hashable]] = {}
        self._branch_ids = itertools.count(1)
        self._anonymous = itertools.count()
        self._by_content = PrefixIndex()
        self._chars = 0
        self._bytes = 0

    def has(self, serial: int, key: str) -> bool:
        """Whether a prompt of ``key`` is kept. A lookup without the lock: a
        prompt kept or dropped meanwhile may be seen either way."""
        return (serial, key) in self._branches

    def by_content(self, serial: int, text: str) -> _Extension:
        """For a keyless prompt: the holder to keep it under, the kept prompt
        it extends (the longest one it starts with) and their shared length."""
        with self._lock:
            holder = self._by_content.longest_prefix_of(text)
            known = self._entries.get(holder) if holder is not None else None
        if known is None or holder[0] != serial:
            return (serial, None, next(self._anonymous)), None, 0
        return holder, known, len(known.prompt.text)

    def branch_for(self, serial: int, key: str, text: str) -> _Extension:
        """For a prompt of conversation ``key``: the holder to keep it under,
        the kept branch it extends (the one it shares the most characters
        with) and their shared length. It starts a new branch when the two
        share more than ``BRANCH_SLACK_CHARS`` characters and part ways more
        than that before the end of either; else it replaces that branch (a
        prompt sharing next to nothing restarts the conversation)."""
        with self._lock:
            candidates = [(holder, self._entries[holder]) for holder in self._branches.get((serial, key), ())]
        scored = [(common_prefix_length(entry.prompt.text, text), holder, entry) for holder, entry in candidates]
        shared, holder, known = max(scored, key=lambda s: s[0], default=(0, None, None))  # the first of equals
        return self._holder(serial, key, holder, known, shared, text), known, shared

    def branch_after(self, serial: int, key: str, after: Fingerprint, tail: str) -> tuple[_Extension, str] | None:
        """The kept prompt of ``key`` whose chain has ``after`` (the newest
        such branch), how the prompt it continues with ``tail`` extends it,
        and that prompt's text; None when no kept prompt has ``after``."""
        with self._lock:
            holders = reversed(self._branches.get((serial, key), ()))
            found = next(((h, self._entries[h]) for h in holders if after.matches(self._entries[h].chain)), None)
        if found is None:
            return None
        holder, known = found
        kept_text, shared_chars = known.prompt.text, after.chars
        shared = shared_chars + common_prefix_length(kept_text[shared_chars:], tail)
        text = kept_text if shared == len(kept_text) == shared_chars + len(tail) else kept_text[:shared_chars] + tail
        return (self._holder(serial, key, holder, known, shared, text), known, shared), text

    def _holder(self, serial: int, key: str, holder: Hashable, known: _Entry | None, shared: int, text: str) -> Hashable:
        """Where a prompt of ``key`` that extends branch ``holder`` (``known``)
        by ``shared`` characters is kept (see ``branch_for``)."""
        if known is None:
            # The first branch has a fixed holder, so that threads starting
            # one conversation at once keep one branch, not one each.
            return (serial, key, 0)
        if BRANCH_SLACK_CHARS <= shared < min(len(known.prompt.text), len(text)) - BRANCH_SLACK_CHARS:
            return (serial, key, next(self._branch_ids))
        return holder

    def touch(self, holder: Hashable, known: _Entry) -> bool:
        """Make ``known`` the most recently used, if ``holder`` still keeps it."""
        with self._lock:
            if self._entries.get(holder) is not known:
                return False
            self._entries.move_to_end(holder)
            return True

    def keep(self, holder: Hashable, entry: _Entry, *, room_only: bool) -> bool:
        """Keep ``entry`` as the newest, then evict the least recently used
        until every limit holds; an entry over the byte budget by itself is
        not kept (and what ``holder`` had is forgotten). With ``room_only``
        it is kept only where it fits without evicting another entry, and
        otherwise what ``holder`` had stays. Returns whether it was kept."""
        config = self._config
        with self._lock:
            old = self._entries.get(holder)
            if room_only and (
                len(self._entries) + (old is None) > config.max_entries
                or self._bytes + entry.nbytes - (old.nbytes if old is not None else 0) > config.max_bytes
            ):
                return False
            self._drop(holder)
            if entry.nbytes > config.max_bytes:
                return False
            self._entries[holder] = entry
            self._chars += len(entry.prompt.text)
            self._bytes += entry.nbytes
            if holder[1] is None:
                self._by_content.add(holder, entry.prompt.text)
            else:
                branches = self._branches.setdefault(holder[:2], [])
                branches.append(holder)
                if len(branches) > MAX_BRANCHES:
                    self._drop(branches[0])
            while len(self._entries) > config.max_entries or self._bytes > config.max_bytes:
                self._drop(next(iter(self._entries)))
            return self._entries.get(holder) is entry

    def _drop(self, holder: Hashable) -> None:
        """Forget what ``holder`` has kept, if anything; the caller holds the lock."""
        old = self._entries.pop(holder, None)
        if old is None:
            return
        self._chars -= len(old.prompt.text)
        self._bytes -= old.nbytes
        if holder[1] is None:
            self._by_content.discard(holder)
        elif holder in (branches := self._branches.get(holder[:2], [])):
            branches.remove(holder)
            if not branches:
                del self._branches[holder[:2]]

    def clear(self) -> None:
        """Forget every kept prompt."""
        with self._lock:
            self._entries.clear()
            self._branches.clear()
            self._by_content = PrefixIndex()
            self._chars = 0
            self._bytes = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._entries), "cached_chars": self._chars, "cached_bytes": self._bytes}


class PrefixTokenCache:
    """Exact prefix-tokenization cache, safe to share between threads.

    ``encode`` returns a new list each call, equal to
    ``tokenizer(text, add_special_tokens=False)["input_ids"]`` for a
    transformers fast tokenizer or to ``tokenizer.encode(text,
    add_special_tokens=False).ids`` for a ``tokenizers.Tokenizer``;
    ``encode_array`` the same ids as a read-only int32 numpy array, without
    building a list. ``extend_if_kept``, ``extend_after`` and ``adopt`` are
    what routing asks of a cache beyond them.
    """

    def __init__(self, config: CacheConfig | None = None):
        self.config = config if config is not None else CacheConfig.from_env()
        self._kept = KeptPrompts(self.config)
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
        return _kept(entry).ids

    def extend_if_kept(self, tokenizer: Any, text: str, key: str) -> np.ndarray | None:
        """``encode_array``'s ids of ``text`` where a prompt of conversation
        ``key`` is kept here, the new prompt kept in its place only where that
        evicts nothing (its owner keeps the conversation too); None, without
        tokenizing or taking a lock, where none is. Raises what ``encode`` raises."""
        _check_input(text, key, keyed=True)
        backend = self._backend_or_none(tokenizer)
        if backend is None or not self._kept.has(backend.serial, key):
            return None
        return _kept(self._entry_or_ids(tokenizer, text, key, room_only=True) if text else []).ids

    def extend_after(self, tokenizer: Any, text: str, key: str, after: Fingerprint | None = None) -> Kept | None:
        """Conversation ``key``'s prompt, tokenized here and kept as its latest: all
        its ids, and whether it is kept. The prompt is ``text`` after the first
        ``after.chars`` characters of the kept prompt of ``key`` whose fingerprint
        chain has ``after`` (``mptok.core.protocol``), or ``text`` itself without
        ``after``; None when no kept prompt has ``after``. Raises what ``encode`` raises."""
        _check_input(text, key, keyed=True)
        extending = None
        if after is not None:
            backend = self._backend_or_none(tokenizer)
            found = None if backend is None else self._kept.branch_after(backend.serial, key, after, text)
            if found is None:
                return None
            extending, text = found
        return _kept(self._entry_or_ids(tokenizer, text, key, extending) if text else [])

    def adopt(self, tokenizer: Any, text: str, key: str, ids: np.ndarray, chain: bytes = b"") -> bool:
        """Keep ``ids``, the exact ids of ``text`` from elsewhere (its owner's
        answer), as conversation ``key``'s copy here where that evicts nothing,
        without tokenizing; ``chain``: digests of ``text``'s first blocks computed
        already. Returns whether it is kept. Raises what ``encode`` raises."""
        _check_input(text, key, keyed=True)
        backend = self._backend_or_none(tokenizer)
        if backend is None or not self._keeps(text):
            return False
        holder = (backend.serial, key, 0)
        return self._kept.keep(holder, _new_entry(holder, CachedPrompt(text, IdPieces.of(ids)), key, chain), room_only=True)

    def stats(self) -> dict[str, float]:
        """Counters since creation, and the current size of the cache: ``cached_bytes``
        (never more than ``max_bytes``), ``allocation_failures`` (``MemoryError``s
        while caching, each emptied the cache), ``tokens_reused`` (ids answered
        from kept prompts) against ``tokens_tokenized``; ``backend_*``:
        ``mptok.cache.backend.backend_stats``."""
        kept = {**self._kept.stats(), "max_bytes": self.config.max_bytes, "disabled": int(self._disabled)}
        return {**self._counters.snapshot(), **backend_stats(), **kept}

    def clear(self) -> None:
        """Forget every kept prompt (counters stay)."""
        self._kept.clear()

    def _keeps(self, text: str) -> bool:
        config = self.config
        # A text costs at least a byte a character.
        return not self._disabled and config.min_chars <= len(text) < config.max_bytes and len(text) > 0

    def _backend(self, tokenizer: Any) -> TokenizerBackend:
        """``backend_for`` ``tokenizer`` and this cache's choice, remembered for the last tokenizer
        (a frontend has one: the process-wide table and its lock are not asked per prompt)."""
        last = self._last_backend
        if last is not None and last[0] is tokenizer:
            return last[1]
        backend = backend_for(tokenizer, self.config.tokenizer_backend)
        self._last_backend = (tokenizer, backend)
        return backend

    def _backend_or_none(self, tokenizer: Any) -> TokenizerBackend | None:
        try:
            return self._backend(tokenizer)
        except SlowTokenizerError:
            return None

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
        if not self._keeps(text):
            self._counters.add("uncached")
        else:
            try:
                return self._encode_cached(backend, text, key, extending, room_only)
            except TokenizerRefused:
                # Exactly what the tokenizer itself does with this text: its ids
                # or its error. Nothing is kept.
                return _call_tokenizer(tokenizer, text)
            except MemoryError:
                # Memory is short: give back what the cache holds and tokenize
                # in full; the cache fills again from the next prompt on.
                self._counters.add("allocation_failures")
                self._kept.clear()
                logger.warning("out of memory while caching a prompt; cache emptied, tokenizing in full")
            except Exception:
                self._disable()
        try:
            ids = backend.encode_ids(text)
        except TokenizerRefused:
            return _call_tokenizer(tokenizer, text)
        self._counters.add("tokens_tokenized", len(ids))
        return ids

    def _encode_cached(
        self, backend: TokenizerBackend, text: str, key: str | None, extending: _Extension | None, room_only: bool
    ) -> _Entry:
        if extending is not None:
            holder, known, shared = extending
        elif key is None:
            holder, known, shared = self._kept.by_content(backend.serial, text)
        else:
            holder, known, shared = self._kept.branch_for(backend.serial, key, text)
        # The kept prompt again: it stays as it is, only its place in the LRU moves.
        if known is not None and shared == len(text) == len(known.prompt.text) and self._kept.touch(holder, known):
            self._counters.add("hits")
            self._counters.add("tokens_reused", known.prompt.ids.length)
            return known
        prompt = None
        if known is not None:
            prompt = extend_prompt(backend, known.prompt, text, shared, max_attempts=self.config.max_seam_attempts)
            if prompt is None:
                self._counters.add("resync_failures")
            else:
                # Sampled against a full tokenization, paid for by the characters tokenized.
                backend.check_splice(text, prompt.ids, len(text) - shared)
        if prompt is None:
            prompt = CachedPrompt(text, IdPieces.of(backend.encode_id_array(text)))
            self._counters.add("misses")
        else:
            self._counters.add("hits")
        self._counters.add("tokens_reused", prompt.reused)
        self._counters.add("tokens_tokenized", prompt.ids.length - prompt.reused)
        entry = _new_entry(holder, prompt, key, _shared_digests(known, shared))
        self._kept.keep(holder, entry, room_only=room_only)
        return entry

    def _disable(self) -> None:
        if self._disabled:
            return
        self._disabled = True
        self._kept.clear()
        logger.warning("prefix token cache disabled after an internal error; tokenizing in full", exc_info=True)

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


def _check_input(text: object, key: object, *, keyed: bool = False) -> None:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, not {type(text).__name__}")
    if key is None and keyed:
        raise TypeError("key must be a str: the call names a conversation")
    if key is not None:
        if not isinstance(key, str):
            raise TypeError(f"key must be a str or None, not {type(key).__name__}")
        if len(key) * 4 > MAX_KEY_BYTES:  # else it cannot be too long: no call per prompt
            check_key(key)


def _call_tokenizer(tokenizer: Any, text: str) -> list[int]:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encode(text, add_special_tokens=False).ids
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
