"""The floor both servers stand on: a supervisor of N processes on one port.

The supervisor and what it runs each slot with (``supervisor``, ``port``,
``run``), the options of the servers on it (``options``), its private
directory (``run_dir``), a child's stop when it dies (``lifeline``), a
child's sign of life (``heartbeat``), each process's counters and their
Prometheus text (``snapshots``, ``metrics``), one log line per event
(``logfmt``), and the bound on the requests a process holds (``admission``).
``mptok serve`` (``mptok.serve``) and ``mptok render`` (``mptok.render``)
are two kinds of process on it, side by side.
"""
