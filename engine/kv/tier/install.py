"""Pages read from the KV disk tier (``engine.kv.tier.disk``) put into an arena: free pages taken, their K/V written
on the arena's device, named and left cached, where ``cached_run`` finds them as it finds pages other sessions
computed. All or nothing: no page changes if there is no room or the copy fails.
"""

from __future__ import annotations

import torch

from engine.errors import EngineError


def install(arena, read: list, names: list[bytes]) -> tuple[list[int], str]:
    """Free pages for ``read`` ((K, V) ``[L, H, P, D]`` each), written, named ``names`` and left cached. Returns
    (the pages, "") or ([], why not: for the user's note)."""
    pool, P, n = arena.pool, arena.page_size, len(read)
    try:
        arena.ensure_free(n)
    except EngineError as e:
        return [], f"no room to restore {n * P} tokens ({e}); they are computed again"
    pages = pool.allocate(n)
    try:
        dev = arena.shape.device
        idx = torch.tensor(pages, device=dev)
        slots = (idx[:, None] * P + torch.arange(P, device=dev)).reshape(-1)  # [n * P]
        for i, r in enumerate("kv"):
            x = torch.cat([kv[i] for kv in read], dim=2).to(dev)  # [L, H, n * P, D]
            for layer, t in enumerate(arena.roles[r].layers):
                t.index_copy_(1, slots, x[layer])
    except (RuntimeError, EngineError) as e:
        for p in pages:
            pool.decref(p)
        return [], f"restoring failed ({e}); the tokens are computed again"
    for p, name in zip(pages, names):
        pool.set_fill(p, P)
        pool.register(p, name)
    for p in pages:
        pool.decref(p)  # cached: the session adopts them as it adopts pages other sessions computed
    return pages, ""
