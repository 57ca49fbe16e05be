"""Send each conversation's prompts to the frontend process whose cache holds it.

``owners.TokenizationOwners`` serves this frontend's cache to its peers and
routes keyed prompts to their owner (``order``), skipping owners that
``liveness`` finds dead or stopped, and speaking the delta protocol: the
asker's side in ``held``, the owner's in ``answer``. It sits on the cache
and the transport, and neither calls back up.
"""
