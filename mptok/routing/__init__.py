"""Send each conversation's prompts to the frontend process whose cache holds it.

``owners.TokenizationOwners`` holds both sides of routing for one frontend
and their lifecycle, and answers peers (the owner's side: one cache call,
``extend_after``, per request). The asker's side is ``router.Router``: a
conversation this frontend keeps is extended here; any other is asked of
the first owner in its order that ``liveness`` does not find dead or
stopped, within one deadline per prompt, and it returns the ids or None:
tokenize here. ``policy`` is what the operator chooses; ``calibration``
what a character costs here at worst, for the asker's patience. It sits on
the cache and the transport, and neither calls back up.
"""
