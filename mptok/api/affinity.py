"""A conversation's identity when its client sends none.

Routing needs a name for each conversation, and most clients of an
OpenAI-compatible server send none (the OpenAI SDKs, agents built on them,
benchmarks). A chat carries its own: the messages up to and including the
first user message do not change from one turn to the next, and they differ
between conversations even when a fleet of agents shares one long system
prompt (each agent gets its own task). Two conversations that begin with the
same messages share an owner, where the cache keeps a branch for each.

A raw prompt has no such stable part. Hashing its first ``affinity_chars``
characters is an opt-in: right only when those differ between
conversations, it sends every conversation whose prompts share a longer
prefix (a common system prompt) to one owner.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from mptok.core.lru import ByteBoundedLru

_HASH_PERSON = b"mptok-affinity1"

# Headers that name the conversation when the body does not, in the order
# they are read (lower-cased, as HTTP/ASGI servers hand them over).
CONVERSATION_HEADERS = ("x-session-id", "x-correlation-id")


class IdentityKind(enum.Enum):
    """Where a prompt's conversation key came from."""

    KEYED = "keyed"  # the client named the conversation
    DERIVED = "derived"  # derived from the conversation's own stable part
    KEYLESS = "keyless"  # no key: not routed, matched by content where it lands


@dataclass(frozen=True)
class ConversationIdentity:
    """The key a prompt is cached and routed under (None: keyless), and its origin."""

    key: str | None
    kind: IdentityKind


def identify(
    explicit_id: str | None, messages: Sequence[dict[str, Any]] | None, prompt: str | None, affinity_chars: int = 0,
    chat_key: Callable[[Sequence[dict[str, Any]]], str | None] | None = None,
) -> ConversationIdentity:
    """The identity of one request's conversation: an explicit id, else a chat's
    ``chat_identity`` (through ``chat_key``, e.g. ``ChatNames.of``, if given),
    else a prompt's ``prompt_identity``, else keyless."""
    if explicit_id:
        return named(explicit_id, None)
    key = None
    if messages is not None:
        key = (chat_key or chat_identity)(messages)
    elif prompt is not None and affinity_chars > 0:
        key = prompt_identity(prompt, affinity_chars)
    return named(None, key)


def named(explicit_id: str | None, derived_key: str | None) -> ConversationIdentity:
    """The identity of a conversation named by the client (``explicit_id``,
    if not empty), else by what mptok derived from it, else by nothing."""
    if explicit_id:
        return ConversationIdentity(explicit_id, IdentityKind.KEYED)
    if derived_key is not None:
        return ConversationIdentity(derived_key, IdentityKind.DERIVED)
    return ConversationIdentity(None, IdentityKind.KEYLESS)


def header_conversation_id(header: Callable[[str], str | None]) -> str | None:
    """The conversation id a request's headers give: the first of
    ``CONVERSATION_HEADERS`` that ``header(name)`` finds and is not empty."""
    return next((value for name in CONVERSATION_HEADERS if (value := header(name))), None)


class ChatNames:
    """``chat_identity`` decided once per conversation, then looked up.

    A chat's stable messages seen before are found by a dict lookup (in C)
    instead of being serialized and digested again; only those whose every
    value is a string or null (``1 == True`` in Python, not in JSON). Bounded
    by ``max_bytes`` of kept messages, least recently used dropped first. Thread-safe.
    """

    def __init__(self, max_bytes: int = 16 << 20):
        self._names: ByteBoundedLru[str] = ByteBoundedLru(max_bytes)

    def of(self, messages: Sequence[dict[str, Any]]) -> str | None:
        """``chat_identity(messages)``."""
        try:
            first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
            if first_user is None:
                return None
            stable = tuple(tuple(m.items()) for m in messages[: first_user + 1])
            plain = all(type(v) is str or v is None for m in stable for _, v in m)
        except Exception:
            return None  # not plain JSON, as chat_identity says
        if not plain:
            return chat_identity(messages)
        key = self._names.get(stable)
        if key is None:
            key = chat_identity(messages)
            nbytes = sum(_NAME_OVERHEAD_BYTES + sum(len(v) for _, v in m if v is not None) for m in stable)
            self._names.put(stable, key, nbytes)
        return key


_NAME_OVERHEAD_BYTES = 200  # a message's tuples, as CPython holds them


def chat_identity(messages: Sequence[dict[str, Any]]) -> str | None:
    """``chat:<hash>`` of the messages up to and including the first user
    message (every field, keys sorted); None if no message is a user's, or if
    they are not plain JSON (a client library's objects, which an engine may hand over).
    """
    try:
        first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
        if first_user is None:
            return None
        stable = orjson.dumps(list(messages[: first_user + 1]), option=orjson.OPT_SORT_KEYS)
    except Exception:
        return None
    return "chat:" + _digest(stable)


def prompt_identity(prompt: str, affinity_chars: int) -> str | None:
    """``prompt:<hash>`` of the first ``affinity_chars`` characters; None for a shorter prompt."""
    if affinity_chars <= 0 or len(prompt) < affinity_chars:
        return None
    # surrogatepass: a lone surrogate is valid in a prompt that the tokenizer
    # will refuse or accept on its own terms; the identity must not raise first.
    return "prompt:" + _digest(prompt[:affinity_chars].encode("utf-8", "surrogatepass"))


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16, person=_HASH_PERSON).hexdigest()
