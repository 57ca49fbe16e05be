"""The front floor that ``mptok serve`` and the vLLM plugin stand on.

``prompt_ids.py`` turns a prompt's text and its conversation's identity into
exact ids (the special-token frame, the encoder, the counting);
``catalogue.py`` declares every mptok series both of them export.
"""
