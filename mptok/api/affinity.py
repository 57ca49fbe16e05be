"""A conversation's identity when its client sends none.

Routing sends each conversation to the frontend that holds it, and it needs
a name for the conversation to do that: a session id in the body or a
header. Most clients of an OpenAI-compatible server send none (the OpenAI
SDKs, agents built on them, benchmarks), so their prompts were never routed
and each frontend extended whatever it had last seen of them.

A chat carries its own identity: the messages up to and including the first
user message do not change from one turn to the next, and they differ
between conversations even when a fleet of agents shares one long system
prompt (each agent gets its own task). Hashed, they choose the owner exactly
as a session id would. Two conversations that begin with the same messages
get the same identity and the same owner; the cache keeps a branch for each
of them under it (``mptok.cache``), so they share an owner without evicting
each other.

A raw prompt carries no structure to find that stable part in. Hashing its
first ``affinity_chars`` characters is offered as an opt-in: it is right
only when those characters differ between conversations, and it sends every
conversation whose prompts share a longer prefix (a common system prompt) to
one owner.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

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
    explicit_id: str | None,
    messages: Sequence[dict[str, Any]] | None,
    prompt: str | None,
    affinity_chars: int = 0,
) -> ConversationIdentity:
    """The identity of one request's conversation: an explicit id, else a chat's
    ``chat_identity``, else a prompt's ``prompt_identity``, else keyless."""
    if explicit_id:
        return named(explicit_id, None)
    if messages is not None:
        key = chat_identity(messages)
    elif prompt is not None and affinity_chars > 0:
        key = prompt_identity(prompt, affinity_chars)
    else:
        key = None
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


def chat_identity(messages: Sequence[dict[str, Any]]) -> str | None:
    """``chat:<hash>`` of the messages up to and including the first user
    message; None if no message is a user's, or if they are not plain JSON
    (objects of a client library, which an engine may hand over).

    Every field of those messages counts (role, content, name, ...), with
    keys sorted, so the same messages give the same identity whatever order
    a client writes their fields in.
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
