"""The controls that act while chatting: cache mode, page size, precision, eviction policy (their forms built
from each policy's ``Params``), sampling, speculative decoding, the KV disk tier; each with its controller that
applies a change between two decode steps. May import ``app.settings``, ``app.shell``'s parts, ``app.link``.
"""
