"""``mptok serve``: N HTTP tokenization frontends on one port, under ``mptok.supervise``'s supervisor.

What the supervisor runs in each slot (``launch``); one frontend process (``frontend``, ``http_protocol``, ``service``).
"""
