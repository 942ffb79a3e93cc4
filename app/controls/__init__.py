"""The controls that act while chatting: cache mode, page size, precision, eviction policy (their forms built
from each policy's ``Params``), sampling, speculative decoding, the KV disk tier; each with its controller that
applies a change between two decode steps (the engine-thread sides, the disk tier's control and the draft
models, are the link's: ``app.link.disk_tier``, ``app.link.spec_drafts``). May import ``app.settings``, the ground,
``app.link``; the link never imports it.
"""
