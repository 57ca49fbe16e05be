"""Exceptions that cross mptok's module boundaries."""


class RouteFailed(Exception):
    """The frontend that owns a conversation did not tokenize its prompt.

    Raised by a cache's ``route`` hook; the cache then tokenizes the prompt
    locally and counts the failure. It never reaches the caller of ``encode``.
    """
