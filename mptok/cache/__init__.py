"""The prefix-tokenization cache of one process, and the tokenizers it drives.

``prefix_cache.PrefixTokenCache`` keeps each conversation's last prompt (its
store, ``KeptPrompts``) and extends it with the seam encoder (``seam``,
which proves every splice by the rules ``seam_rules`` derives and checks at
start), finds a kept prompt by its content (``prefix_index``), and drives
private copies of the caller's tokenizer (``backend``, loaded by
``loading``; it tokenizes in full on the floor below, ``mptok.engines``)
within the limits of ``config.CacheConfig``. It never leaves its process:
routing, a layer above, moves prompts to it, through ``protocols``, which
describes what the layers above rely on.
"""
