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

import dataclasses
import itertools
import logging
import secrets
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from mptok.backend import SlowTokenizerError, TokenizerBackend, TokenizerRefused, backend_for
from mptok.config import CacheConfig, check_key
from mptok.errors import RouteFailed
from mptok.ids import IdPieces, common_prefix_length, held_bytes
from mptok.peer import PeerReply
from mptok.prefix_index import PrefixIndex
from mptok.seam import CachedPrompt, extend_prompt, tokenize_prompt

logger = logging.getLogger(__name__)

Route = Callable[[str, str], "list[int] | None"]

# Earlier versions of a conversation whose ids an owner remembers, so that a
# peer holding one of them gets only the ids that changed (``encode_for_peer``).
# A peer last saw a conversation about F turns ago, but the gap is geometric:
# with F = 4, 8 versions left 7% of routed prompts (replayed) needing a second
# call with the whole text; 16 leave about 1% ((3/4)^16). The versions share
# their id lists (``IdPieces``) until a splice compacts them, so the ids kept
# for 16 are a few lists per conversation, not 16. A version that shares no
# character with the newest prompt is of no use to a peer and is dropped.
PEER_HISTORY = 16

# Prompts kept under one conversation key. Two conversations may share a key
# (one derived from their identical first messages, ``mptok.affinity``; a
# client that reuses a session id; a regenerated answer): each keeps a branch
# of its own, and a prompt extends the branch it shares the most with,
# instead of the conversations evicting each other turn after turn.
MAX_BRANCHES = 4
# A prompt that parts from the branch it extends within this many characters
# of the end of either replaces that branch (a chat template rewrites its
# generation prompt, a few characters, every turn; a client resends an
# earlier turn); one that parts earlier starts a branch of its own.
BRANCH_SLACK_CHARS = 256

# What an entry costs beyond its text, ids and offsets, which are counted by
# size: the entry, prompt and IdPieces objects, the holder tuple, the slots of
# the LRU dict and of the content index. Measured with tracemalloc
# (scripts/bench_memory.py) and rounded up.
ENTRY_OVERHEAD_BYTES = 1024
# Per remembered version: its tuple, IdPieces and piece tuples.
VERSION_OVERHEAD_BYTES = 256


@dataclass(frozen=True)
class _Entry:
    """A kept prompt, its version, and what the owner remembers of the
    versions before it: ``(version, ids, chars shared with this prompt)``;
    ``nbytes`` is what it all costs (``entry_bytes``)."""

    prompt: CachedPrompt
    version: int
    history: tuple[tuple[int, IdPieces, int], ...]
    nbytes: int = 0


def entry_bytes(holder: Hashable, prompt: CachedPrompt, history: tuple[tuple[int, IdPieces, int], ...]) -> int:
    """Bytes a kept prompt holds: its key, text, the lists of its ids and of
    its remembered versions' ids (each list once: versions share them), its
    offsets window and bookkeeping. O(pieces), not O(tokens)."""
    return (
        held_bytes(holder, prompt.text, prompt.ids, *(ids for _, ids, _ in history))
        + sys.getsizeof(prompt.starts)
        + sys.getsizeof(prompt.ends)
        + sys.getsizeof(prompt.word_starts)
        + ENTRY_OVERHEAD_BYTES
        + VERSION_OVERHEAD_BYTES * len(history)
    )


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
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        # (backend serial, key) -> the holders of that key's branches, oldest first.
        self._branches: dict[tuple[int, str], list[Hashable]] = {}
        self._branch_ids = itertools.count(1)
        self._cached_chars = 0
        self._cached_bytes = 0
        self._by_content = PrefixIndex()
        self._anonymous = itertools.count()
        # Versions start at a random number: a peer that names a version of a
        # previous run of this frontend must not find it here.
        self._versions = itertools.count(secrets.randbits(62) + 1)
        self._disabled = False
        self._warned_slow = False
        self._counts = dict.fromkeys(
            ("hits", "misses", "resync_failures", "uncached", "routed", "route_failures", "allocation_failures"),
            0,
        )

    # -- public API ---------------------------------------------------------

    def encode(self, tokenizer: Any, text: str, key: str | None = None) -> list[int]:
        """Token ids of ``text``; may ask ``route`` to tokenize it elsewhere.

        ``key`` names the conversation; without it, the longest kept prompt
        that ``text`` starts with is extended. Raises ``TypeError`` for text
        that is not a str, ``ValueError`` for a key longer than
        ``mptok.config.MAX_KEY_BYTES`` (256 UTF-8 bytes), and whatever the
        tokenizer itself raises.
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

    def encode_for_peer(
        self,
        tokenizer: Any,
        key: str | None,
        text: str,
        *,
        since: int | None = None,
        shared_chars: int = 0,
    ) -> PeerReply | None:
        """Tokenize a prompt of conversation ``key`` for a peer; never routes.

        Without ``since``, ``text`` is the whole prompt and the reply holds
        all its ids. With ``since``, the peer holds the ids of this
        conversation's prompt version ``since``, and ``text`` holds only the
        characters after the first ``shared_chars``, which the new prompt
        shares with that version. Returns None when this cache cannot rebuild
        the prompt (it does not remember that version, or not that many of
        its characters); the peer then sends the whole text. A prompt without
        a key has no versions: it is answered whole.
        """
        _check_input(text, key)
        if key is None:
            return None if since is not None else PeerReply(0, 0, self._encode_here(tokenizer, text, None))
        try:
            backend = backend_for(tokenizer)
        except SlowTokenizerError:
            return None if since is not None else PeerReply(0, 0, self.encode_local(tokenizer, text, key))
        old_ids = None
        if since is not None:
            with self._lock:
                branches = self._branches_of(backend.serial, key)
            found = next(
                ((entry, known) for entry in branches if (known := _version_in(entry, since)) is not None), None
            )
            if found is None or not 0 <= shared_chars <= found[1][1]:
                return None
            entry, (old_ids, _) = found
            text = entry.prompt.text[:shared_chars] + text
        try:
            entry = self._entry_here(backend, text, key)
        except TokenizerRefused:
            return PeerReply(0, 0, _call_tokenizer(tokenizer, text))
        if entry is None:  # not kept
            return PeerReply(0, 0, self._encode_full(backend, tokenizer, text))
        ids = entry.prompt.ids
        reused = old_ids.common_prefix(ids) if old_ids is not None else 0
        return PeerReply(entry.version, reused, ids.slice(reused, ids.length))

    def stats(self) -> dict[str, int]:
        """Counters since creation, and the current size of the cache.

        ``cached_bytes`` is everything the kept conversations hold (see
        ``CacheConfig.max_bytes``), never more than ``max_bytes``.
        ``allocation_failures`` counts ``MemoryError``s while caching: each
        emptied the cache, and the prompt was tokenized in full.
        """
        with self._lock:
            return dict(
                self._counts,
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

    # -- internals ----------------------------------------------------------

    def _keeps(self, text: str) -> bool:
        config = self.config
        return (
            not self._disabled
            and config.min_chars <= len(text) < config.max_bytes  # a text costs at least a byte a character
            and (config.max_cached_chars is None or len(text) <= config.max_cached_chars)
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
        try:
            entry = self._entry_here(backend, text, key)
        except TokenizerRefused:
            # Exactly what the tokenizer itself does with this text: its ids
            # or its error. Nothing is kept.
            return _call_tokenizer(tokenizer, text)
        if entry is None:
            return self._encode_full(backend, tokenizer, text)
        return entry.prompt.ids.to_list()

    def _entry_here(self, backend: TokenizerBackend, text: str, key: str | None) -> _Entry | None:
        """The entry kept for ``text``, made here; None if the text is not kept.

        Raises ``TokenizerRefused`` for text the Rust tokenizer refuses.
        """
        if not self._keeps(text):
            self._count("uncached")
            return None
        try:
            return self._encode_cached(backend, text, key)
        except TokenizerRefused:
            raise
        except MemoryError:
            # Memory is short: give back what the cache holds and tokenize
            # in full; the cache fills again from the next prompt on.
            with self._lock:
                self._counts["allocation_failures"] += 1
                self._forget_all()
            logger.warning("out of memory while caching a prompt; cache emptied, tokenizing in full")
            return None
        except Exception:
            self._disable()
            return None

    def _encode_cached(self, backend: TokenizerBackend, text: str, key: str | None) -> _Entry:
        if key is None:
            holder, known, shared = self._kept_by_content(backend, text)
        else:
            holder, known, shared = self._branch_for(backend, key, text)
        config = self.config
        prompt = None
        if known is not None:
            prompt = extend_prompt(
                backend,
                known.prompt,
                text,
                shared,
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
        history = _history_after(known, shared)
        compact = prompt.ids.bounded()
        if compact is not prompt.ids:
            # Joined into one list: the remembered versions move onto it, or
            # they would keep the old lists alive beside the new one.
            history = tuple((version, ids.rebased(prompt.ids, compact), chars) for version, ids, chars in history)
            prompt = dataclasses.replace(prompt, ids=compact)
        entry = _Entry(prompt, next(self._versions), history, entry_bytes(holder, prompt, history))
        self._keep(holder, entry, by_content=key is None)
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
        if known is None:
            # The first branch has a fixed holder, so that threads starting
            # one conversation at once keep one branch, not one each.
            holder = (backend.serial, key, 0)
        elif BRANCH_SLACK_CHARS <= shared < min(len(known.prompt.text), len(text)) - BRANCH_SLACK_CHARS:
            holder = (backend.serial, key, next(self._branch_ids))
        return holder, known, max(shared, 0)

    def _branches_of(self, serial: int, key: str) -> list[_Entry]:
        """The kept branches of ``key``, newest first; the caller holds the lock."""
        return [self._entries[holder] for holder in reversed(self._branches.get((serial, key), ()))]

    def _keep(self, holder: Hashable, entry: _Entry, *, by_content: bool) -> None:
        """Keep ``entry`` as the newest, then evict the least recently used
        until every limit holds; an entry over the byte budget by itself is
        not kept (and what ``holder`` had is forgotten)."""
        config = self.config
        with self._lock:
            self._drop(holder)
            if entry.nbytes > config.max_bytes:
                return
            self._entries[holder] = entry
            self._cached_chars += len(entry.prompt.text)
            self._cached_bytes += entry.nbytes
            if by_content:
                self._by_content.add(holder, entry.prompt.text)
            else:
                branches = self._branches.setdefault(holder[:2], [])
                branches.append(holder)
                if len(branches) > MAX_BRANCHES:
                    self._drop(branches[0])
            while (
                len(self._entries) > config.max_entries
                or self._cached_bytes > config.max_bytes
                or (config.max_cached_chars is not None and self._cached_chars > config.max_cached_chars)
            ):
                self._drop(next(iter(self._entries)))

    def _drop(self, holder: Hashable) -> None:
        """Forget what ``holder`` has kept, if anything; the caller holds the lock."""
        old = self._entries.pop(holder, None)
        if old is not None:
            self._cached_chars -= len(old.prompt.text)
            self._cached_bytes -= old.nbytes
            self._by_content.discard(holder)
            branches = self._branches.get(holder[:2])
            if branches is not None and holder in branches:
                branches.remove(holder)
                if not branches:
                    del self._branches[holder[:2]]

    def _encode_full(self, backend: TokenizerBackend, tokenizer: Any, text: str) -> list[int]:
        try:
            return backend.encode(text).ids
        except TokenizerRefused:
            return _call_tokenizer(tokenizer, text)

    def _forget_all(self) -> None:
        """Drop every kept prompt; the caller holds the lock."""
        self._entries.clear()
        self._branches.clear()
        self._by_content = PrefixIndex()
        self._cached_chars = 0
        self._cached_bytes = 0

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

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
                stacklevel=4,
            )


def _history_after(known: _Entry | None, shared: int) -> tuple[tuple[int, IdPieces, int], ...]:
    """The history of the entry that replaces ``known`` with a prompt sharing
    its first ``shared`` characters."""
    if known is None or shared == 0:
        return ()
    history = ((known.version, known.prompt.ids, shared),) + tuple(
        (version, ids, min(chars, shared)) for version, ids, chars in known.history if chars > 0
    )
    return history[:PEER_HISTORY]


def _version_in(entry: _Entry, version: int) -> tuple[IdPieces, int] | None:
    """The ids of ``version`` of ``entry``'s conversation, and how many of its
    characters ``entry``'s prompt shares; None if it is not remembered."""
    if entry.version == version:
        return entry.prompt.ids, len(entry.prompt.text)
    for known, ids, shared in entry.history:
        if known == version:
            return ids, shared
    return None


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
