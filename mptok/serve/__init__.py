"""``mptok serve``: N HTTP tokenization frontends on one port, under the supervisor.

What the supervisor runs in each slot (``launch``), one frontend process
(``frontend``, ``http_protocol``, ``service``). The supervisor, the options
and what operators read are ``mptok.supervise``'s; the command is
``mptok.cli``.
"""
