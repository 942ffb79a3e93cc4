"""Seeded random rotations (and QJL projections) for rotated KV quantization, one per layer, head and role.

- head_dim a power of two: ``R = H · diag(s2) · H · diag(s1) / D``, H the Walsh–Hadamard matrix (Sylvester order),
  s1 and s2 random signs — the fast Walsh–Hadamard transform with random signs, twice (``fwht``: log2(D) butterfly
  passes each, O(D log D)). One round is not enough for keys: a vector with one outlier channel comes out with
  every coordinate ±|x|/√D, the same magnitude whatever the signs, so its error is fixed, not the codebook's
  expectation (one 25.0 channel among 0.05s at D = 64, 3 bits: 0.0625 of ‖x‖² under every seed, over the paper's
  0.0425 bound); the second round spreads those equal magnitudes into ~Gaussian coordinates (0.034);
- any other head_dim (80, 96, ...): a random orthogonal matrix, the Q of a Gaussian matrix's QR with its signs fixed
  so it is Haar-distributed;
- QJL: a D × D matrix of N(0, 1) entries (the projection whose signs are kept for the keys' residual).

Every draw comes from numpy's PCG64 seeded by ``SeedSequence((SEED, layer, head, role, what))``: the same model,
layer, head and role always get the same matrix, on any machine (a page swapped out and back, or quantized by
another session of the same arena, decodes the same). Applied as dense ``[H, D, D]`` matrices in one batched
matmul: on this CPU that beat the butterfly for every shape the cache uses (``fwht`` builds the matrix and is the
reference the tests compare with).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

SEED = 0x7A51_33  # any fixed number; changing it changes every rotation (pages are never kept across)
ROLE_INDEX = {"k": 0, "v": 1}
ROTATION, QJL = 0, 1


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def rng(layer: int, head: int, role: str, what: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence((SEED, layer, head, ROLE_INDEX[role], what))))


def fwht(x: Tensor) -> Tensor:
    """Orthonormal fast Walsh–Hadamard transform along the last dim (a power of two): ``x @ H.T / √D``."""
    d = x.shape[-1]
    if not is_power_of_two(d):
        raise ValueError(f"fwht: {d} is not a power of two")
    lead = x.shape[:-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)  # pairs (a, b) h apart
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(*lead, d) / math.sqrt(d)


def rotation(head_dim: int, layer: int, head: int, role: str) -> np.ndarray:
    """The orthogonal ``[D, D]`` float64 matrix R of this layer, head and role (``y = R x``)."""
    g = rng(layer, head, role, ROTATION)
    if is_power_of_two(head_dim):
        s1, s2 = (torch.from_numpy(g.choice((-1.0, 1.0), size=head_dim)) for _ in range(2))
        # R's rows applied to the identity: column j of R is R e_j = H s2 ⊙ H (s1 ⊙ e_j) / D
        return fwht(fwht(torch.diag(s1)) * s2).numpy().T.copy()
    a = g.standard_normal((head_dim, head_dim))
    q, r = np.linalg.qr(a)
    return q * np.sign(np.diag(r))[None, :]  # Haar: the QR's sign ambiguity removed


def qjl(head_dim: int, layer: int, head: int, role: str) -> np.ndarray:
    """The QJL projection S ``[D, D]`` of N(0, 1) entries, float64."""
    return rng(layer, head, role, QJL).standard_normal((head_dim, head_dim))


def stack(fn, heads: int, head_dim: int, layer: int, role: str, device, dtype=torch.float32) -> Tensor:
    """``fn(head_dim, layer, h, role)`` for every head h, as one ``[H, D, D]`` tensor."""
    mats = np.stack([fn(head_dim, layer, h, role) for h in range(heads)])
    return torch.from_numpy(mats).to(device=device, dtype=dtype)
