"""Send each conversation's prompts to the frontend process whose cache holds it.

``owners.TokenizationOwners`` holds both sides of routing for one frontend
and their lifecycle. The asker's side is ``router.Router``: for a keyed
prompt it picks the conversation's owner (``order``); a conversation this
frontend keeps is extended here, any other is asked of the first owner
that ``liveness`` does not find dead or stopped, with the fingerprint it
holds (``held``), within one deadline per prompt (``deadline``, patience
from this process's worst cost per character, ``calibration``), and it
returns the ids or None: tokenize here. The owner's side is
``answer.PeerService``, one cache call (``keep``) per request.
``switch_interval`` is for the process that serves peers. It sits on the
cache and the transport, and neither calls back up.
"""
