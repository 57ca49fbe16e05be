"""``mptok serve``: N HTTP tokenization frontends on one port, under a supervisor.

The command line (``cli``, ``options``), the supervisor and its private
directory (``supervisor``, ``run_dir``, ``lifeline``), one frontend process
(``frontend``, ``http_protocol``, ``service``), and what operators read
(``logfmt``, ``metrics``). The top layer: nothing imports it.
"""
