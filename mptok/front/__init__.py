"""The front floor that ``mptok serve`` and the engine plugins stand on: a prompt to exact ids, every series they export."""
