"""Send each conversation's prompts to the frontend process whose cache holds it.

``owners.TokenizationOwners`` holds both sides of routing for one frontend
and their lifecycle. The asker's side is ``router.Router``: for a keyed
prompt it picks the conversation's owner (``order``), skipping owners that
``liveness`` finds dead or stopped, weighs the crossing (``crossing``, with
this process's cost per character from ``calibration``), asks the owner
with the fingerprint it holds (``held``) within one deadline per prompt
(``deadline``), and returns a plain decision: the ids, or tokenize here.
The owner's side is ``answer.PeerService``, one cache call per request.
``switch_interval`` is for the process that serves peers. It sits on the
cache and the transport, and neither calls back up.
"""
