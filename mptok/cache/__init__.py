"""The prefix-tokenization cache of one process, and the tokenizers it drives.

``prefix_cache`` keeps each conversation's last prompt and extends it with
the seam encoder (``seam``, on the rules ``seam_rules`` derives); it drives
private copies of the caller's tokenizer (``backend``) and never leaves its
process: routing, a layer above, moves prompts to it (``protocols``).
"""
