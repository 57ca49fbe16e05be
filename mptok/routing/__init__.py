"""Send each conversation's prompts to the frontend process whose cache holds it.

``owners.TokenizationOwners`` serves this frontend's cache to its peers and
routes keyed prompts to their owner (``order``) when that pays
(``crossing``, with this process's cost per character from
``calibration``), skipping owners that ``liveness`` finds dead or stopped,
within one deadline per prompt (``deadline``), and speaking the peer
protocol: the asker's fingerprints in ``held``, the owner's one-call answer
in ``answer``. ``switch_interval`` is for the process that serves peers. It
sits on the cache and the transport, and neither calls back up.
"""
