"""Expected-attention scores (``engine.policies.expected``): the recent queries of each full-attention layer, and
from their statistics the attention each cached key should expect from the coming queries.

``QueryStats`` is fed by the attention itself: while a policy that ``needs_queries`` is on, every forward hands
each full-attention layer's queries, keys and values (as the attention uses them: post-RoPE, dequantized) to
``observe`` (``engine.kv.hf_cache`` puts it in the attention's arguments, ``engine.kv.store.attention`` calls
it beside the model's own SDPA). ``observe`` keeps the last ``window`` queries of the layer; on the forward
after which the evictor trims the cache (``begin(score=True)``) it also scores every key the forward attended to
and writes the scores into the evictor's ``Scores`` (one ``[Hkv, n]`` row per layer, in slot order).

Costs (SmolLM2-135M's 30 layers, 9 query heads of 64 channels, 2 cores): keeping the queries is a copy of
``[Hq, q, D]`` per layer and forward; scoring is ``Hq * n * D^2`` multiply-adds per layer (the covariance
term), once per eviction (every ``slack`` tokens), and is timed (``ms``) for the snapshot.
"""

from __future__ import annotations

import time

import torch

from engine.kv.store.rope import LayerRope, keyless_layers, rope_layout_or_reason, rotate

FUTURE = 512  # RoPE averaged over this many coming positions (kvpress's n_future_positions)


class QueryStats:
    """Per full-attention layer (score row): the last queries (post-RoPE, with their positions, in a ring), and the
    scoring of keys from them (un-rotated to before RoPE only then: one rotation per eviction, not per token).

    ``to_model[row]``: the model layer of score row ``row`` (a grouped store's full layers; else the identity)."""

    def __init__(self, model, num_rows: int, to_model: list[int] | None = None) -> None:
        self.model, self.num_rows = model, num_rows
        self.to_model = list(to_model) if to_model is not None else list(range(num_rows))
        self.window, self.sinks, self.future = 128, 4, FUTURE
        self.q: list[torch.Tensor | None] = [None] * num_rows  # ring of queries [Hq, W, D] (post-RoPE)
        self.pos: list[torch.Tensor | None] = [None] * num_rows  # [W] their RoPE positions, -1: empty slot
        self.head = [0] * num_rows  # next ring slot to write
        self.scale: list[float | None] = [None] * num_rows  # the attention's scale, as the last forward passed it
        self._specs: list[LayerRope | None] | None = None  # per model layer; [] when positions cannot be read
        self._start, self._score, self._next = 0, False, 0  # this forward's first RoPE position, scoring, after it
        self.scores = None  # the evictor's ``Scores`` (written on a scoring forward)
        self.ms = 0.0  # time spent in ``observe`` (the policy's cost; ``SeqCache.take_policy_ms`` reads and resets)
        self.seen = False  # a forward was observed since ``clear`` (scores are from queries, not zeros)
        self._mean_key, self._mean = None, None  # the last averaged rotation (cos, sin) and what it was for

    def configure(self, window: int, sinks: int, layout=None) -> None:
        """The policy's query window and sinks; ``layout``: a grouped store's layer layout (its full layers are the
        score rows; its keyless layers carry no RoPE), None for a model whose every layer is full attention."""
        if int(window) != self.window:
            self.clear()
        self.window, self.sinks = int(window), int(sinks)
        if layout is not None:
            self.to_model = list(layout.full)
        if self._specs is None:
            keyless = keyless_layers(getattr(layout, "kinds", ()))
            found = rope_layout_or_reason(self.model, keyless)
            self._specs = [] if isinstance(found, str) else list(found)

    @property
    def specs(self) -> "list[LayerRope | None] | None":
        """Each model layer's RoPE layout, read once (None before; [] where positions cannot be read)."""
        return self._specs

    def clear(self) -> None:
        self.q, self.pos, self.head = [None] * self.num_rows, [None] * self.num_rows, [0] * self.num_rows
        self.scale = [None] * self.num_rows
        self.seen = False

    def copy_from(self, other: "QueryStats") -> None:
        self.q = [t.clone() if t is not None else None for t in other.q]
        self.pos = [t.clone() if t is not None else None for t in other.pos]
        self.head, self.to_model, self.scale = list(other.head), list(other.to_model), list(other.scale)
        self.window, self.sinks, self._specs, self.seen = other.window, other.sinks, other.specs, other.seen

    def begin(self, start: int, q: int, score: bool) -> None:
        """Before a forward that feeds ``q`` tokens from RoPE position ``start``; ``score``: the evictor trims
        the cache after it (so this forward scores every key)."""
        self._start, self._score, self._next = start, score, start + q

    # -- in the attention ----------------------------------------------------------------------------------
    def observe(self, row: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scaling: float | None) -> None:
        """query [1, Hq, q, D] post-RoPE at this forward's positions; key [1, Hkv, n, D], value [1, Hkv, n, Dv]
        every cached slot the forward attends to, in slot order."""
        t0 = time.perf_counter()
        self.scale[row] = scaling if scaling is not None else query.shape[-1] ** -0.5
        n, W = query.shape[2], self.window
        first = max(n - W, self.sinks - self._start, 0)  # the sinks' queries are outliers (kvpress leaves them out)
        if first < n:
            self._keep(row, query[0, :, first:], self._start + first)
        if self._score and self.scores is not None and self.scores.tracking:
            self.scores.put(row, self._expected(row, key[0], value[0], self.scale[row]))
        self.ms += (time.perf_counter() - t0) * 1000.0

    def score_store(self, store, next_rope: int) -> bool:
        """Score every key the store holds now, from the queries seen (the budget lowered between two steps: the
        eviction that follows at once needs scores of now, not of the last scoring forward). False where it cannot
        (no query seen, a layer whose cached keys are not what its attention reads: MLA's latent)."""
        if not self.seen or self.scores is None or not self.scores.tracking or not hasattr(store, "read_layer"):
            return False
        t0 = time.perf_counter()
        self._next = next_rope
        try:
            for row in range(self.num_rows):
                k, v = store.read_layer(row)  # [H, n, D] each
                buf = self.q[row]
                if buf is None or self.scale[row] is None or k.shape[-1] != buf.shape[-1] or buf.shape[0] % k.shape[0]:
                    return False
                self.scores.put(row, self._expected(row, k, v, self.scale[row]))
        finally:
            self.ms += (time.perf_counter() - t0) * 1000.0
        return True

    def _keep(self, row: int, q: torch.Tensor, start: int) -> None:
        """q [Hq, m, D] (m <= W) at positions ``start..start+m-1`` into the layer's ring."""
        buf = self.q[row]
        if buf is None or buf.shape[0] != q.shape[0] or buf.shape[2] != q.shape[2]:
            buf = self.q[row] = torch.zeros((q.shape[0], self.window, q.shape[2]), dtype=torch.float32,
                                            device=q.device)  # [Hq, W, D]
            self.pos[row] = torch.full((self.window,), -1, dtype=torch.long)
            self.head[row] = 0
        m, h = q.shape[1], self.head[row]
        if m == 1:
            buf[:, h].copy_(q[:, 0])
            self.pos[row][h] = start
        else:
            slots = (torch.arange(m) + h) % self.window  # [m]
            buf.index_copy_(1, slots.to(buf.device), q.float())
            self.pos[row][slots] = torch.arange(start, start + m)
        self.head[row] = (h + m) % self.window
        self.seen = True

    def _spec(self, row: int, width: int) -> LayerRope | None:
        """The layer's RoPE where queries can be moved through it (a key-role rotation within the query's width)."""
        specs = self._specs or []
        m = self.to_model[row]
        spec = specs[m] if m < len(specs) else None
        return spec if spec is not None and spec.role == "k" and spec.rotary_dim <= width else None

    def _expected(self, row: int, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """k [Hkv, n, D], v [Hkv, n, Dv] → expected attention × ||v||: [Hkv, n]."""
        hkv, n, d = k.shape
        buf, pos = self.q[row], self.pos[row]
        if buf is None or not bool((pos >= 0).any()):  # no query seen: every key alike, the value's norm decides
            return v.float().norm(dim=-1)
        filled = (pos >= 0).nonzero().flatten()
        q = buf[:, filled.to(buf.device)]  # [Hq, m, D] post-RoPE
        spec = self._spec(row, d)
        if spec is not None:
            q = _rotate_by(q, -pos[filled], spec)  # back to before RoPE
        hq, m = q.shape[0], q.shape[1]
        mu = q.mean(1)  # [Hq, D]
        c = q - mu[:, None]  # [Hq, m, D]
        cov = c.transpose(1, 2) @ c / m  # [Hq, D, D]
        if spec is not None:  # the coming positions' RoPE, averaged: a linear map R̄ (mean cos / sin per pair)
            key = (id(spec.inv_freq), self._next, self.future, q.device)
            if self._mean_key != key:  # the same for every layer of one forward (one rope module)
                self._mean_key, self._mean = key, _mean_rotation(spec, self._next, self.future, q.device)
            cos, sin = self._mean  # [1, R/2] each
            mu = rotate(mu[:, None], cos, sin, spec.rotary_dim, spec.interleaved)[:, 0]  # R̄ mu: [Hq, D]
            cov = rotate(cov, cos, sin, spec.rotary_dim, spec.interleaved)  # S R̄^T (each row moved)
            cov = rotate(cov.transpose(1, 2), cos, sin, spec.rotary_dim, spec.interleaved)  # R̄ S R̄^T
        g = hq // hkv
        kf = k.float()[:, None]  # [Hkv, 1, n, D]
        mu = mu.reshape(hkv, g, d, 1)  # [Hkv, g, D, 1]
        cov = cov.reshape(hkv, g, d, d)  # [Hkv, g, D, D]
        logit = scale * (kf @ mu)[..., 0] + 0.5 * scale * scale * ((kf @ cov) * kf).sum(-1)  # [Hkv, g, n]
        p = torch.softmax(logit, dim=-1).mean(1)  # [Hkv, n]: expected attention, the KV group's mean
        return p * v.float().norm(dim=-1)  # [Hkv, n]


def _rotate_by(x: torch.Tensor, delta: torch.Tensor, spec: LayerRope) -> torch.Tensor:
    """x [H, m, D] moved by ``delta`` [m] positions through the layer's RoPE (float64 angles, as ``Rerotator``)."""
    angles = delta.double()[:, None] * spec.inv_freq[None]  # [m, R/2]
    cos = angles.cos().to(device=x.device, dtype=torch.float32)
    sin = angles.sin().to(device=x.device, dtype=torch.float32)
    return rotate(x, cos, sin, spec.rotary_dim, spec.interleaved)


def _mean_rotation(spec: LayerRope, start: int, count: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cos and sin of RoPE's angles over positions ``[start, start + count)``: [1, R/2] each. RoPE is linear in
    (cos, sin), so rotating by these is the mean of the rotations."""
    pos = torch.arange(start, start + count, dtype=torch.float64)[:, None]  # [count, 1]
    angles = pos * spec.inv_freq[None]  # [count, R/2]
    return (angles.cos().mean(0, keepdim=True).to(device=device, dtype=torch.float32),
            angles.sin().mean(0, keepdim=True).to(device=device, dtype=torch.float32))
