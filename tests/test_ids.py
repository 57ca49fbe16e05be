"""The compact store of ids (``mptok.core.ids``): int32 buffers shared by
versions, splices, views that never change, and honest byte counts, checked
against plain lists."""

from __future__ import annotations

import random
from array import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mptok.core.ids import (
    HEADROOM_SHARE,
    MIN_HEADROOM_IDS,
    NO_IDS,
    IdPieces,
    as_id_array,
    common_prefix_length,
    held_bytes,
)

ids_lists = st.lists(st.integers(0, 2**31 - 1), max_size=600)


@settings(max_examples=300, deadline=None)
@given(base=ids_lists, data=st.data())
def test_splices_equal_list_splices_and_never_change_earlier_versions(base, data):
    """A chain of splices, each of an earlier version chosen at random:
    every version always reads what list slicing says it holds."""
    versions = [(IdPieces.of(base), list(base))]
    for _ in range(data.draw(st.integers(1, 8))):
        pieces, plain = versions[data.draw(st.integers(0, len(versions) - 1))]
        keep = data.draw(st.integers(0, len(plain)))
        if data.draw(st.booleans()):  # the seam re-tokenized ids that were there already
            tail = plain[keep:] + data.draw(ids_lists)
        else:
            tail = data.draw(ids_lists)
        versions.append((pieces.spliced(keep, tail), plain[:keep] + tail))
        for pieces, plain in versions:
            assert pieces.length == len(plain)
            assert pieces.to_list() == plain


def test_appending_shares_the_buffer_and_rewriting_copies_it():
    base = IdPieces.of(list(range(1000)))
    appended = base.spliced(990, list(range(990, 1000)) + [7, 8, 9])  # the seam re-tokenized 10 equal ids
    assert appended.buffer is base.buffer and appended.to_list() == list(range(1000)) + [7, 8, 9]
    # A second extension of the old version cannot write where the first did.
    other = base.spliced(1000, [1, 2])
    assert other.buffer is not base.buffer
    assert appended.to_list()[-3:] == [7, 8, 9] and other.to_list() == list(range(1000)) + [1, 2]
    # A rewrite of the last ids copies; a prefix shares.
    rewritten = appended.spliced(995, [5, 5])
    assert rewritten.buffer is not appended.buffer and rewritten.to_list() == list(range(995)) + [5, 5]
    assert appended.spliced(500, []).buffer is appended.buffer


def test_a_view_handed_out_never_changes_and_cannot_be_written():
    base = IdPieces.of([1, 2, 3])
    view = base.array()
    assert view.dtype == np.int32 and not view.flags.writeable
    with pytest.raises(ValueError):
        view[0] = 9
    longer = base.spliced(3, [4, 5])
    assert longer.buffer is base.buffer and view.tolist() == [1, 2, 3]
    assert longer.array().tolist() == [1, 2, 3, 4, 5]


def test_byte_counts_are_what_the_buffers_pin():
    n = 40_000
    pieces = IdPieces.of(list(range(n)))
    room = max(MIN_HEADROOM_IDS, n // HEADROOM_SHARE)
    assert pieces.nbytes >= 4 * (n + room)
    assert pieces.nbytes <= 4 * (n + room) + 200
    # A version that shares the buffer pins all of it; two versions of one
    # buffer count it once; a short prefix view still pins the whole buffer.
    longer = pieces.spliced(n, [1, 2, 3])
    assert longer.nbytes == pieces.nbytes
    assert held_bytes("k", "", pieces, longer) == held_bytes("k", "", pieces)
    assert pieces.spliced(10, []).nbytes == pieces.nbytes
    assert NO_IDS.nbytes == 0 and IdPieces.of([]) is NO_IDS


def test_concurrent_extensions_of_one_version_never_mix():
    import threading

    base = IdPieces.of(list(range(100)))
    results: dict[int, IdPieces] = {}

    def extend(i: int) -> None:
        results[i] = base.spliced(100, [i] * 50)

    threads = [threading.Thread(target=extend, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(r.buffer is base.buffer for r in results.values()) == 1
    for i, result in results.items():
        assert result.to_list() == list(range(100)) + [i] * 50


def test_id_arrays_from_lists_buffers_and_arrays():
    assert as_id_array([1, 2, 3]).dtype == np.int32
    raw = array("i", [4, 5, 6])
    same = as_id_array(raw)
    assert same.tolist() == [4, 5, 6] and np.shares_memory(same, np.frombuffer(raw, dtype=np.int32))
    assert as_id_array(np.array([7, 8], dtype=np.int64)).dtype == np.int32
    with pytest.raises(OverflowError):
        as_id_array([1 << 40])
    with pytest.raises(OverflowError):
        as_id_array(np.array([1 << 40]))
    with pytest.raises(ValueError):
        as_id_array(np.zeros((2, 2), dtype=np.int32))
    assert as_id_array([]).tolist() == []


@pytest.mark.parametrize("kind", ["ascii", "ucs2", "mixed"])
def test_common_text_prefix_anywhere(kind):
    """The first differing character of two long texts, found wherever it is:
    inside the doubling windows, past the largest window, in the last one,
    and where one text is a prefix of the other."""
    rng = random.Random(kind)
    alphabet = {"ascii": "ab \n", "ucs2": "｜é中 ", "mixed": "ab｜ \n"}[kind]
    base = "".join(rng.choice(alphabet) for _ in range(70_000))
    for at in (0, 1, 63, 64, 65, 1000, 16_383, 16_384, 40_000, 69_999):
        changed = base[:at] + "\N{SNOWMAN}" + base[at + 1 :]
        assert common_prefix_length(base, changed) == at
        assert common_prefix_length(changed, base[: at + 5]) == at
    assert common_prefix_length(base, base[:50_000]) == 50_000
    assert common_prefix_length(base[:50_000], base) == 50_000
