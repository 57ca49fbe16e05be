"""Send each conversation's prompts to the frontend process whose cache holds it.

``owners.TokenizationOwners`` holds both sides for one frontend: the
owner's (``owners``) and the asker's (``router``, which asks the first
owner ``liveness`` finds worth calling); ``policy`` is what the operator
chooses, ``calibration`` what a character costs here at worst.
"""
