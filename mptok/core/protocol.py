"""What both sides of the peer protocol share: the reply, and how a fingerprint crosses.

A frontend that routes a conversation to its owner keeps a fingerprint of
the prompt it sent (``mptok.core.fingerprint``; ``mptok.routing.held``),
not the text or its ids. Its next turn sends only the characters after
those the fingerprint covers, with the fingerprint (the transport's
``since`` and ``shared_chars``); the owner finds the kept prompt whose
leading characters have that fingerprint, tokenizes the new prompt from
there in one cache call (``PrefixTokenCache.answer_peer``) and answers with
all its ids, as int32 (4 bytes an id on the wire, about what holding them
would cost the asker in memory). When no kept prompt has that fingerprint
it answers None and the asker sends the whole text. The transport carries
``PeerReply`` without reading its ids. Every layer that speaks of it
imports it from here, the bottom layer.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mptok.core.ids import as_id_array


@dataclass(frozen=True)
class PeerReply:
    """An owner's answer for one prompt: all its ids.

    ``version`` names the prompt as the owner kept it (0 if it was not kept:
    the asker then keeps no fingerprint of it). ``reused`` is always 0 in
    this protocol (the asker holds no ids to reuse); an asker refuses a
    reply with any other value.
    """

    version: int
    reused: int
    ids: np.ndarray | array | Sequence[int]  # int32 array from the cache; an int32 memoryview from the transport

    def id_array(self) -> np.ndarray:
        """The ids as an int32 array, without a copy when they are int32 already."""
        return as_id_array(self.ids)
