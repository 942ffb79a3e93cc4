"""What an eviction does on each kind of layer, in one line for the user, where that is not just the textbook
method on every layer.

A policy chooses which tokens go from the cache index, which follows the full-attention layers. On a model
whose layers differ (``engine.kv.store.grouped``) the other kinds do what the model itself does with them:

* sliding-window layers keep their whole window (it already bounds them). When StreamingLLM moves the positions
  handed to the model back to in-cache positions, the window's keys are shifted by the same amount
  (``engine.kv.store.rope.shift_all``): RoPE attention depends on query - key positions only, so a sliding layer
  attends exactly as the model's own sliding window does;
* recurrent / convolution states go on over every token, as the model runs them: they hold no positions and
  cannot drop a token, so the position ids they are given do not matter to them;
* multi-head latent attention (DeepSeek) caches a position-free latent and a small rotary key: only the
  rotary key is re-rotated.

Layouts and rerotators are read by duck type (``layout.full``, ``window_groups()``, ``states``;
``rerotator.layers``), so this module imports neither.
"""

from __future__ import annotations


def _layers(n: int, what: str) -> str:
    return f"{n} {what} layer{'s' if n != 1 else ''}"


def _verb(n: int, one: str, many: str) -> str:
    return one if n == 1 else many


def layer_kind_summary(layout, policy, rerotator) -> str:
    """One line (without the policy's name) for ``policy`` on a model of ``layout`` (None: every layer full
    attention); ``rerotator``: the ``Rerotator`` used when the eviction moved positions, None when it did not.
    Empty when the eviction is the textbook method on every layer."""
    if layout is None:
        return _mla(rerotator)
    parts = []
    if layout.full:
        parts.append(_full_part(layout.full, policy, rerotator))
    for w, layers in layout.window_groups().items():
        parts.append(_window_part(w, layers, rerotator))
    if layout.states:
        n = len(layout.states)
        beside = " beside the attention" if any(layout.kinds[i] != "state" for i in layout.states) else ""
        parts.append(f"{n} recurrent / convolution state{'s' if n != 1 else ''}{beside} "
                     f"{_verb(n, 'goes', 'go')} on over every token as the model runs {_verb(n, 'it', 'them')} "
                     "(no positions in a state, and no token it could drop)")
    return "; ".join(parts)


def _full_part(full: list[int], policy, rerotator) -> str:
    what = _layers(len(full), "full-attention")
    if rerotator is None:
        return f"{what}: evicted within the budget, every kept key at its own position"
    sinks = getattr(policy.params, "sinks", 0)
    kept = f"{sinks} sinks + the most recent tokens"
    if not any(rerotator.layers[m] is not None for m in full):
        return f"{what} (no RoPE): {kept}, nothing to re-rotate"
    return f"{what}: {kept}, keys re-rotated to in-cache positions (StreamingLLM)"


def _window_part(window: int, layers: list[int], rerotator) -> str:
    n = len(layers)
    what, keep = f"{_layers(n, 'sliding')} (window {window})", _verb(n, "keeps its", "keep their")
    if rerotator is None:
        return f"{what}: {keep} window, nothing evicted there"
    if not any(rerotator.layers[m] is not None for m in layers):
        return f"{what} (no RoPE): {keep} whole window as it is"
    return (f"{what}: {keep} whole window, the keys shifted by as many positions as the queries, so "
            f"{_verb(n, 'it attends', 'they attend')} exactly as the model's sliding window does")


def _mla(rerotator) -> str:
    """A model of full-attention layers only: a note only for MLA, whose re-rotation is not the usual one."""
    specs = [s for s in (rerotator.layers if rerotator is not None else ()) if s is not None]
    if not specs or specs[0].role != "v":
        return ""
    return (f"multi-head latent attention: only the cached rotary key ({specs[0].rotary_dim} channels a token) is "
            "re-rotated to in-cache positions; the cached latent carries no position and stays as it is")
