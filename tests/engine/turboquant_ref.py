"""The reference side of the TurboQuant comparison: the ``turboquant`` package (0.2.0) on stories260K, teacher-forced.

Run inside the venv ``turboquant_env.ensure_venv`` made (it has the package and scipy; torch and transformers are
the project's own, by a .pth, so both sides run the same library versions):

    python tests/engine/turboquant_ref.py MODEL_DIR TOKENS.json BITS RESIDUAL OUT.json

Feeds the tokens one at a time through HF's model with (a) ``DynamicCache`` and (b) ``TurboQuantCache(bits)``
whose layers keep the ``RESIDUAL`` most recent tokens in full precision (the package's default is 128; its class
takes it as an argument; a negative RESIDUAL -P: our policy instead, the page of P tokens being filled exact), and writes perplexity and top-1 agreement of (b) against (a) — the rows
``python -m engine quality`` writes for ours.

As shipped, 0.2.0 does not run here: its codebook calls ``np.trapz`` (gone in numpy 2) and its cache's ``update``
does not take the ``kwargs=`` transformers 5.24 passes. Both are bridged below without touching its arithmetic.
"""

from __future__ import annotations

import json
import math
import sys

import torch


def forced_logits(model, ids: list[int], cache) -> torch.Tensor:
    rows = []
    with torch.inference_mode():
        for i, t in enumerate(ids[:-1]):
            out = model(input_ids=torch.tensor([[t]]), position_ids=torch.tensor([[i]]), past_key_values=cache,
                        use_cache=True)
            rows.append(out.logits[0, -1].float())
    return torch.stack(rows)  # [T-1, vocab]


def main(model_dir: str, tokens: str, bits: int, residual: int, out: str) -> int:
    import numpy as np
    from transformers import AutoModelForCausalLM, DynamicCache

    if not hasattr(np, "trapz"):  # numpy 2 renamed it; 0.2.0's codebook (bits >= 2) calls np.trapz and fails without
        np.trapz = np.trapezoid
    from turboquant import cache as tq_cache

    ids = json.loads(open(tokens).read())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    ref = forced_logits(model, ids, DynamicCache())
    layer = tq_cache.TurboQuantLayer

    class Cache(tq_cache.TurboQuantCache):
        """The package's cache with its layers' residual window set, and ``update`` taking the ``kwargs=`` that
        transformers 5.24's attention passes (the package's own ``update(..., cache_kwargs=None)`` raises TypeError
        on it: as shipped, 0.2.0 does not run on this transformers)."""

        def update(self, key_states, value_states, layer_idx, cache_kwargs=None, **_):
            while len(self.layers) <= layer_idx:
                self.layers.append(layer(bits=self.bits, residual_len=residual))
            return self.layers[layer_idx].update(key_states, value_states, cache_kwargs)

    class PageLayer(layer):
        """The package's layer with our window: the page being filled (``-RESIDUAL`` tokens a page) stays exact and
        is quantized whole when its last token is written — the package's quantizer, our policy."""

        def update(self, key_states, value_states, cache_kwargs=None):
            held = self._residual_keys.shape[-2] if self._residual_keys is not None else 0
            total = held + key_states.shape[-2]
            self.residual_len = total % -residual if total >= -residual else 10 ** 9  # whole pages quantized
            return super().update(key_states, value_states, cache_kwargs)

    if residual < 0:
        layer = PageLayer
    got = forced_logits(model, ids, Cache(bits=bits))
    target = torch.tensor(ids[1:])
    ref_nll = torch.nn.functional.cross_entropy(ref, target).item()
    nll = torch.nn.functional.cross_entropy(got, target).item()
    row = {"bits": bits, "residual": residual, "perplexity": round(math.exp(nll), 4),
           "reference_perplexity": round(math.exp(ref_nll), 4), "perplexity_ratio": round(math.exp(nll - ref_nll), 4),
           "top1_agreement": round((got.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4), "tokens": len(ids)}
    open(out, "w").write(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]))
