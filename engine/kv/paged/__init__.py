"""Paged bookkeeping in plain ints, no tensors: the page pool (refcounts, owners, fill, the free queue,
prefix-cache names), block tables and the slot plan, the cache index (logical and RoPE positions), prefix-chain
names, tenants' roots, byte formulas shared with the app. Imports nothing of the engine but ``engine.errors``.
"""
