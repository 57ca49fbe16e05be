"""Find the longest kept prompt that a new prompt starts with, without a scan.

Prompts that arrive without a conversation id are matched by content: the
new prompt must start with a kept one. Comparing against every kept prompt
would cost O(entries x length) per request, so each prompt is filed under a
fingerprint of its first ``n`` blocks of ``BLOCK_CHARS`` characters, chained
block by block. A lookup computes the same chain over the new prompt and
visits one bucket per block boundary, deepest first; every candidate is
confirmed with ``str.startswith``, so a fingerprint collision costs a compare,
never a wrong answer.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

BLOCK_CHARS = 4096

# Characters of each block that go into its fingerprint. The chain is only a
# filter (startswith confirms), so sampling the end of each block keeps the
# cost per block constant instead of hashing the whole text every request.
SAMPLE_CHARS = 64


def _fingerprints(text: str, blocks: int) -> Iterator[int]:
    """Fingerprints of ``text``'s first 0, 1, ..., ``blocks`` full blocks."""
    chain = hash(("mptok", 0))
    yield chain
    for block in range(1, blocks + 1):
        end = block * BLOCK_CHARS
        chain = hash((chain, text[end - SAMPLE_CHARS : end]))
        yield chain


class PrefixIndex:
    """Maps prompts to their holders' keys by content prefix. Not thread-safe:
    the cache calls it under its own lock."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[int, int], dict[Hashable, str]] = {}
        self._filed: dict[Hashable, tuple[int, int]] = {}

    def add(self, holder: Hashable, text: str) -> None:
        """File ``text`` for ``holder``, replacing what ``holder`` had filed."""
        self.discard(holder)
        blocks = len(text) // BLOCK_CHARS
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
        blocks = len(text) // BLOCK_CHARS
        chain = list(_fingerprints(text, blocks))
        for depth in range(blocks, -1, -1):
            bucket = self._buckets.get((depth, chain[depth]))
            if not bucket:
                continue
            best = max(
                (h for h, filed in bucket.items() if text.startswith(filed)),
                key=lambda h: len(bucket[h]),
                default=None,
            )
            if best is not None:
                return best
        return None

    def __len__(self) -> int:
        return len(self._filed)
