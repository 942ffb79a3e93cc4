"""The fixed-size state of a hybrid model's recurrent / convolution layers (Mamba, linear attention, short
convolutions: LFM2, Falcon-H1, Qwen3-Next, Jamba, Zamba2, ...), held per session.

transformers' own layer objects keep it (``LinearAttentionLayer``: ``conv_states`` and ``recurrent_states``
per sub-state), so the model's code finds them where it expects them. A state summarises every token it has
seen and cannot be cut back: a new turn either continues it (its prompt extends everything the session fed)
or starts it again from zero. Its size does not depend on the conversation's length.
"""

from __future__ import annotations

import torch


class StateLayers:
    def __init__(self, config, layer_ids: list[int]) -> None:
        from transformers import DynamicCache

        self.config = config
        self.layer_ids = list(layer_ids)
        cache = DynamicCache(config=config)  # the layer classes (and their arguments) transformers uses
        self.layers = {i: cache.layers[i] for i in self.layer_ids}

    def __bool__(self) -> bool:
        return bool(self.layer_ids)

    def reset(self) -> None:
        """Back to the state before any token (in place: the model's cache holds these very objects)."""
        for layer in self.layers.values():
            for name in ("conv_states", "recurrent_states"):
                getattr(layer, name).update(dict.fromkeys(getattr(layer, name)))
            for flags in (layer.is_conv_states_initialized, layer.is_recurrent_states_initialized,
                          layer.has_previous_state):
                flags.update(dict.fromkeys(flags, False))

    def layer_bytes(self, i: int) -> int:
        layer = self.layers.get(i)
        if layer is None:
            return 0
        return sum(t.numel() * t.element_size() for name in ("conv_states", "recurrent_states")
                   for t in getattr(layer, name).values() if t is not None)

    @property
    def nbytes(self) -> int:
        return sum(self.layer_bytes(i) for i in self.layer_ids)

    def snapshot(self, to=None) -> dict:
        """Every state tensor copied (to device ``to``, default where it is), with the flags."""
        out = {}
        with torch.inference_mode():
            for i, layer in self.layers.items():
                out[i] = {name: {k: (None if t is None else t.to(to or t.device, copy=True))
                                 for k, t in getattr(layer, name).items()}
                          for name in ("conv_states", "recurrent_states")}
                out[i]["flags"] = {name: dict(getattr(layer, name)) for name in (
                    "is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state",
                    "conv_kernel_size")}
                out[i]["where"] = (layer.device, layer.dtype)
        return out

    def restore(self, saved: dict) -> None:
        """Put a ``snapshot`` back (onto each layer's own device)."""
        with torch.inference_mode():
            for i, layer in self.layers.items():
                entry = saved[i]
                device, dtype = entry["where"]
                layer.device, layer.dtype = device, dtype
                for name in ("conv_states", "recurrent_states"):
                    getattr(layer, name).update({k: None if t is None else t.to(device or t.device, copy=True)
                                                 for k, t in entry[name].items()})
                for name, flags in entry["flags"].items():
                    getattr(layer, name).update(flags)

    def moved(self, saved: dict, to=None) -> dict:
        """A ``snapshot`` copied to device ``to`` (None: each layer's own device): a checkpoint swapped out and in."""
        out = {}
        with torch.inference_mode():
            for i, entry in saved.items():
                device = to if to is not None else (entry["where"][0] or "cpu")
                out[i] = {**entry, **{name: {k: None if t is None else t.to(device, copy=True)
                                             for k, t in entry[name].items()}
                                      for name in ("conv_states", "recurrent_states")}}
        return out

    def nbytes_of(self, saved: dict) -> int:
        return sum(t.numel() * t.element_size() for e in saved.values() for name in ("conv_states", "recurrent_states")
                   for t in e[name].values() if t is not None)
