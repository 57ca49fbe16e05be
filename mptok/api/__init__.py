"""What a client's request may hold, as vLLM's ``/tokenize`` defines it, without any server.

Parsing and the 4xx a client gets (``tokenize_request``), vLLM's rules beyond
parsing (``vllm_contract``), chat messages to prompt text
(``chat_template``), and a conversation's name when the client sends none
(``affinity``). Both ``mptok serve`` and the vLLM plugin stand on it.
"""
