"""The engines that tokenize in full, below the cache, and the trust placed in them.

``choice.Engines`` is all the cache sees; ``fast`` loads, checks, times and
chooses the engines at start; ``memo`` keeps a start's verdict for the next.
"""
