"""The engines that tokenize in full, below the cache, and the trust placed in them.

``choice.Engines`` is all the cache sees: ids, id arrays, the engines'
names, and the check of a result against the reference tokenizer, which the
cache hands in as a callable. ``fast`` loads fastokens and gigatoken and
checks and times them at start, ``tripwire`` re-checks their results while
they serve, and ``memo`` keeps a start's verdict for the next start.
"""
