"""Exceptions that cross mptok's module boundaries."""


class RouteFailed(Exception):
    """The frontend that owns a conversation did not tokenize its prompt.

    Raised inside ``mptok.TokenizationOwners`` when a call to an owner
    fails; the prompt is then tokenized locally and the failure counted. It
    never reaches the caller of ``encode``.
    """
