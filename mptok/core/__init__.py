"""The bottom layer: what every other layer shares.

Counters and histograms (``counting``), token ids held compactly (``ids``),
and the types both sides of the peer protocol speak (``protocol``). Nothing
here imports another mptok layer.
"""
