"""The floor both servers stand on: a supervisor of N processes on one port, and what its processes share.

``mptok serve`` (``mptok.serve``) and ``mptok render`` (``mptok.render``)
are two kinds of process on it, side by side; docs/ARCHITECTURE.md names
what each module here holds.
"""
