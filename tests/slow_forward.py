"""``SlowForward``: a model's forward made slower, for tests that must look at replies while they run."""

from __future__ import annotations

import time


class SlowForward:
    """The model's forward made ``seconds`` slower (stories260K alone decodes ~400 tokens/s: a reply could end
    before a test holds it mid-stream on a busy machine). ``undo()`` restores it."""

    def __init__(self, model, seconds: float) -> None:
        self.model, self.seconds, self._forward = model, seconds, model.forward
        model.forward = self  # an instance attribute: nn.Module.__call__ finds it before the method

    def __call__(self, *args, **kwargs):
        time.sleep(self.seconds)
        return self._forward(*args, **kwargs)

    def undo(self) -> None:
        del self.model.forward
