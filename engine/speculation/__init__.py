"""Speculative decoding: drafts (prompt lookup, a draft model on its own cache), their verification against
the model's own sampling (``verify``), adaptive draft length and auto-off. May import ``engine.core``'s
sequence, cache and sampler, ``engine.model.loader``; never ``engine.server`` or ``engine.tools``.
"""
