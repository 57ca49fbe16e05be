"""What a client's request may hold, as vLLM's ``/tokenize`` defines it, without any server.

``mptok serve`` and the engine plugins stand on it.
"""
