"""The engines that tokenize in full, below the cache, and the trust placed in them.

``choice.Engines`` is all the cache sees: ids, id arrays, the engines'
names, and the check of a result, which the cache hands in as a callable;
it re-checks the engines' results while they serve. ``fast`` loads
fastokens and gigatoken, checks and times them at start and chooses, and
``memo`` keeps a start's verdict for the next start.
"""
