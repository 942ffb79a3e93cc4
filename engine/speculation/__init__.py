"""Speculative decoding's draft model: a smaller model on a cache of its own proposing tokens (``draft_model``).
The verification of drafts against the model's own sampling, prompt lookup and the speculator the core steps live in
the core (``engine.core.verify``, ``engine.core.speculation_setup``): the core never imports this room. May import
``engine.core``'s sequence and cache, ``engine.model.loader``; never ``engine.server`` or ``engine.tools``.
"""
