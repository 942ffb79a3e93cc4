"""The child process that builds the compiled decode step (``engine.model.aot_step`` says why and where): the model's
class from its config with throwaway weights, ``torch.export`` of ``engine.model.runner.step_function`` (or
``batch_step_function``: ``job["kind"]``) with the lengths (and the batch) dynamic, AOTInductor with the weights left out, the package written atomically.

``python -m engine.model.aot_build BUILD_DIR`` (``BUILD_DIR/job.json``); the last line of its output says why it failed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from engine.model.aot_step import MAX_BATCH, MIN_LEN


def step_module(model):
    """``engine.model.runner.step_function`` as an ``nn.Module`` for ``torch.export`` (the weights are ``m.*``)."""
    import torch

    from engine.model.runner import step_function

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model
            self._step = step_function(model)

        def forward(self, ids, pos, slots, ks, vs):
            return self._step(ids, pos, slots, ks, vs)

    return Step()


def batch_module(model):
    """``engine.model.runner.batch_step_function`` as an ``nn.Module`` for ``torch.export``."""
    import torch

    from engine.model.runner import batch_step_function

    class BatchStep(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model
            self._step = batch_step_function(model)

        def forward(self, ids, pos, slots, lens, ks, vs):
            return self._step(ids, pos, slots, lens, ks, vs)

    return BatchStep()


def _export(model, job: dict, dtype, dev):
    """The exported step of ``job["kind"]`` over example page tensors, the lengths (and the batch) dynamic."""
    import torch

    L, (hk, dk), (hv, dv) = job["layers"], job["k"], job["v"]
    P = 16
    ks = [torch.zeros((hk, 4 * P, dk), dtype=dtype, device=dev) for _ in range(L)]  # [H, S, D] page rows
    vs = [torch.zeros((hv, 4 * P, dv), dtype=dtype, device=dev) for _ in range(L)]
    S = torch.export.Dim("S", min=MIN_LEN, max=1 << 24)
    N = torch.export.Dim("N", min=MIN_LEN, max=1 << 24)
    pages = [{1: S}] * L
    if job.get("kind", "step") == "batch":
        B = torch.export.Dim("B", min=2, max=MAX_BATCH)
        b = 3  # the example batch: no size the tracer would specialise on (0, 1, or N's)
        slots = torch.arange(2 * P, device=dev).repeat(b, 1)  # [B, N] each sequence's cached slots, padded
        lens = torch.full((b,), 2 * P, dtype=torch.long, device=dev)  # [B] how many are its own
        ids = torch.zeros((b, 1), dtype=torch.long, device=dev)
        pos = torch.full((b, 1), 2 * P, dtype=torch.long, device=dev)
        args = (ids, pos, slots, lens, ks, vs)
        dims = ({0: B}, {0: B}, {0: B, 1: N}, {0: B}, pages, pages)
        return torch.export.export(batch_module(model), args, strict=False, dynamic_shapes=dims)
    slots = torch.arange(2 * P, device=dev)  # [N] the cached tokens' slots
    ids = torch.zeros((1, 1), dtype=torch.long, device=dev)
    pos = torch.full((1, 1), 2 * P, dtype=torch.long, device=dev)
    return torch.export.export(step_module(model), (ids, pos, slots, ks, vs), strict=False,
                               dynamic_shapes=(None, None, {0: N}, pages, pages))


def _like_the_parent(model, job: dict) -> None:
    """The parent's attention dispatcher and packed-linear structure (plain weights here: ``_linear_pointwise``
    takes either, and the parent hands the package its packed ones)."""
    from engine.kv.store.attention import DISPATCH_IMPL, use_attention
    from engine.model import linear_kernel
    from engine.model.prepack import Plan, restructure

    linear_kernel.IN_GRAPH = bool(job.get("native_linear"))  # the blocked linears call the native product
    if job.get("attn") == DISPATCH_IMPL:
        use_attention(model, DISPATCH_IMPL)
    if job.get("prepack"):
        restructure(model, Plan.from_json(job["prepack"]), packed=False)


def _build(build: Path) -> None:
    """The child: build the model with throwaway weights, export its step, compile, write the package."""
    import torch
    import transformers

    job = json.loads((build / "job.json").read_text())
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(build)
    cls = getattr(transformers, job["class"])
    dtype, dev = getattr(torch, job["dtype"]), torch.device(job["device"])
    if job.get("blocks"):  # a GGUF's kept blocks: the graph calls the block operators (engine.quant.modules)
        from engine.quant.gguf_keep import skeleton

        model = skeleton(cls, config, dtype, job["blocks"]).to(dev)
    else:
        model = cls._from_config(config, dtype=dtype, attn_implementation="sdpa").to(dev).eval()
    _like_the_parent(model, job)
    t0 = time.perf_counter()
    with torch.no_grad():
        ep = _export(model, job, dtype, dev)
    t1 = time.perf_counter()
    out = Path(job["out"])
    tmp = out.with_name(f"{out.stem}.{os.getpid()}.tmp.pt2")
    torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp),
                                             inductor_configs={"aot_inductor.package_constants_in_so": False})
    os.replace(tmp, out)  # whole or absent: a reader never sees half a package
    print(json.dumps({"export_s": round(t1 - t0, 2), "compile_s": round(time.perf_counter() - t1, 2)}), flush=True)


if __name__ == "__main__":
    try:
        os.nice(10)  # the user's chat (eager meanwhile) comes first on a small machine
    except (AttributeError, OSError):
        pass
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    try:
        _build(Path(sys.argv[1]))
    except BaseException as e:  # noqa: BLE001 - the parent reads the reason from the last line
        print(f"{type(e).__name__}: {e}"[:400].replace("\n", " "), file=sys.stderr, flush=True)
        sys.exit(1)
