"""A prompt's text and its conversation's identity in, its exact ids out: what every front of mptok does.

``mptok serve`` and the engine plugins all end in the same step, here once:
the ids of one text, exactly ``tokenizer(text, add_special_tokens=...)["input_ids"]``,
through routing (``TokenizationOwners``) when there is routing, else the
cache; for ``add_special_tokens=True`` framed by the tokenizer's fixed
``SpecialTokenFrame``, else left to the tokenizer's own call; counted in the
``"prompts"`` section of the snapshot both exporters read (``mptok.front.catalogue``).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from mptok.api.affinity import ConversationIdentity
from mptok.api.special_tokens import SpecialTokenFrame
from mptok.cache.backend import SlowTokenizerError, backend_for
from mptok.cache.protocols import Routing, TokenCache
from mptok.core.counting import Counters
from mptok.core.deadline import Deadline
from mptok.core.ids import as_id_array
from mptok.front.catalogue import DIRECT_PROMPT_TOKENS, DIRECT_PROMPTS, ENGINE_NAMES, ERRORS, PROMPT_COUNTS, PROMPT_TOKENS, TEXT_LENGTHS


class PromptIds:
    """Exact ids of prompt text for one tokenizer, through ``routing`` (if any) or ``cache``.

    ``ids`` and ``ids_array`` raise what the encoder raises (counted as an error).
    """

    def __init__(self, tokenizer: Any, cache: TokenCache, routing: Routing | None = None):
        self._tokenizer = tokenizer
        self._cache = cache
        self._routing = routing
        self.frame: SpecialTokenFrame | None = SpecialTokenFrame.derive(tokenizer)
        if self.frame is not None:
            self._prefix, self._suffix = as_id_array(list(self.frame.prefix)), as_id_array(list(self.frame.suffix))
        # transformers' __call__ is not thread-safe ("Already borrowed"): every call of the tokenizer object itself holds this.
        self.tokenizer_lock = threading.Lock()
        self._counts = Counters(PROMPT_COUNTS)

    def route_through(self, routing: Routing) -> None:
        """Tokenize through ``routing`` from now on (a process whose routing starts after its cache)."""
        self._routing = routing

    def through_mptok(self, text: str, add_special_tokens: bool) -> bool:
        """Whether mptok gives this prompt's ids (else only the tokenizer's own call does)."""
        return not add_special_tokens or (self.frame is not None and bool(text))

    def ids(self, text: str, add_special_tokens: bool, identity: ConversationIdentity) -> list[int] | None:
        """Exactly ``tokenizer(text, add_special_tokens=...)["input_ids"]``; None when only the tokenizer's own call gives them."""
        if not self.through_mptok(text, add_special_tokens):
            return None
        # The frame goes on the array: one list is made, of the final ids.
        return self._framed_array(text, add_special_tokens, identity).tolist()

    def ids_array(self, text: str, add_special_tokens: bool, identity: ConversationIdentity, *, deadline: Deadline | None = None) -> np.ndarray:
        """``ids`` as a 1-D int32 array (the cache's own when unframed: no list is made), never None.
        ``deadline``: by when the route must have decided (routing only; the request's arrival deadline)."""
        if not self.through_mptok(text, add_special_tokens):
            with self.tokenizer_lock:
                direct = as_id_array(self._tokenizer(text, add_special_tokens=True)["input_ids"])
            self.count_direct(len(direct))
            return direct
        return self._framed_array(text, add_special_tokens, identity, deadline)

    def count_direct(self, tokens: int) -> None:
        """One prompt of ``tokens`` tokens that the tokenizer's own call tokenized, not mptok."""
        self._counts.add(DIRECT_PROMPTS)
        self._counts.add(DIRECT_PROMPT_TOKENS, tokens)

    def snapshot(self) -> dict[str, Any]:
        """``"cache"``, ``"routing"`` (when routing), ``"prompts"`` and ``"engines"``: the sections ``mptok.front.catalogue`` reads."""
        snapshot: dict[str, Any] = {"cache": self._cache.stats(), "prompts": self._counts.snapshot(), "engines": self._engines()}
        if self._routing is not None:
            snapshot["routing"] = self._routing.stats()
        return snapshot

    def _engines(self) -> dict[str, dict[str, int]]:
        """For each length of text, 1 for the engine that tokenizes it in full, 0 for the others."""
        try:
            names = backend_for(self._tokenizer, self._cache.config.tokenizer_backend).engines.names
        except SlowTokenizerError:
            names = {}
        return {texts: {engine: int(names.get(texts) == engine) for engine in ENGINE_NAMES} for texts in TEXT_LENGTHS}

    def _framed_array(self, text: str, add_special_tokens: bool, identity: ConversationIdentity, deadline: Deadline | None = None) -> np.ndarray:
        try:
            if self._routing is not None:
                ids = self._routing.encode_array(self._tokenizer, text, key=identity.key, deadline=deadline)
            else:
                ids = self._cache.encode_array(self._tokenizer, text, key=identity.key)
        except Exception:
            self._counts.add(ERRORS)
            raise
        if add_special_tokens:
            ids = np.concatenate((self._prefix, ids, self._suffix))
        self._counts.add(identity.kind.value)
        self._counts.add(PROMPT_TOKENS, len(ids))
        return ids
