"""The compiled decode step, built ahead of time in a child process: ``torch.export`` of the model's own decode
step (``engine.model.runner.step_function``) and AOTInductor (``aoti_compile_and_package``), weights left out of the
package (``package_constants_in_so=False``), so the parent loads it in milliseconds and hands it its own weight
tensors (``load_constants(..., user_managed=True)``: no copy).

Why a child process: while inductor traces a model in a process, torch.fx patches ``nn.Module.__call__`` for the
whole process, so a forward in another thread fails (seen: "module is not installed as a submodule") and every
forward had to wait for the compile (37 s for the first reply after launch on a 2-core machine). The child
builds the same model class from the same config with throwaway weights (only shapes, dtypes and the code
matter: the weights are the parent's), compiles at low priority on one thread, and writes the package
atomically; nothing in the parent waits for it.

Packages are kept per model shape in the user's cache folder (``package_path``): the next launch loads the step
at once. The key covers the config, dtype, device type and the versions of torch, transformers and this step.

The child is ``python -m engine.model.aot_build BUILD_DIR`` (``BUILD_DIR/job.json``, written here, says what to build).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

STEP_VERSION = 4  # bump when the step's inputs or outputs change: old packages are then never loaded
MIN_LEN = 2  # the dynamic lengths' floor: a size-1 example would specialise the graph
MAX_BATCH = 64  # the most sequences the batched step takes in one call (``engine serve`` runs up to 16 by default)


def cache_root() -> Path:
    """``$KVSCOPE_COMPILE_CACHE``, else ``$XDG_CACHE_HOME/kvscope/aot`` (``~/.cache/kvscope/aot``)."""
    env = os.environ.get("KVSCOPE_COMPILE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvscope" / "aot"


def inductor_cache_dir() -> str:
    """Inductor's own kernel cache: ``$XDG_CACHE_HOME/kvscope/torch-compile`` (``~/.cache/...``), not /tmp, which
    a reboot empties. ``engine`` sets ``TORCHINDUCTOR_CACHE_DIR`` to it at import unless the user set it: torch
    sets it to /tmp the first time anything asks for its cache folder, which loading a model does."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvscope", "torch-compile")


KINDS = ("step", "batch")  # one sequence's decode step; several sequences' (``engine.model.fast_batch``)


def package_key(model, device_type: str, kind: str = "step") -> str:
    """What the compiled code depends on: the model's class and config, its dtype, the device type, versions, and
    which step it is."""
    import torch
    import transformers

    cfg = model.config.to_dict()
    for k in ("_attn_implementation", "_name_or_path", "transformers_version", "_commit_hash"):
        cfg.pop(k, None)
    param = _float_param(model)
    blob = json.dumps({"class": type(model).__name__, "config": cfg, "dtype": str(param.dtype), "device": device_type,
                       "torch": torch.__version__, "transformers": transformers.__version__, "step": STEP_VERSION,
                       "attn": _attn(model), "prepack": _prepack(model),
                       **({"blocks": _blocks(model)} if _blocks(model) else {}),
                       **({"kind": kind} if kind != "step" else {}),
                       **({"native_linear": True} if _native_linear(model) else {})}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _float_param(model):
    """The parameter whose dtype is the model's (a GGUF's kept blocks are uint8: the first float one)."""
    return next((p for p in model.parameters() if p.is_floating_point()), next(model.parameters()))


def _blocks(model) -> list | None:
    """A GGUF model's block modules (``engine.quant.gguf_keep.block_plan``): the child builds the same ones."""
    return getattr(model, "kvscope_block_plan", None) or None


def _attn(model) -> str:
    """The attention the step is traced with: the runner's dispatcher where it selected one (bf16 decode attention
    in float32, ``engine.kv.store.attention.sdpa``), else sdpa."""
    from engine.kv.store.attention import DISPATCH_IMPL

    return DISPATCH_IMPL if getattr(model.config, "_attn_implementation", None) == DISPATCH_IMPL else "sdpa"


def _prepack(model) -> list | None:
    """The packed linears' plan (``engine.model.prepack``): the child builds the same modules, so the package's
    parameter names and its oneDNN calls match the parent's packed weights."""
    from engine.model.prepack import plan_of

    plan = plan_of(model)
    return plan.to_json() if plan is not None else None


def _native_linear(model) -> bool:
    """Does a step built now call the native product for the model's blocked linears
    (``engine.model.linear_kernel.in_graph``)? The package's graph differs, so its key does."""
    from engine.model import linear_kernel

    from engine.model.prepack import plan_of

    plan = plan_of(model)
    return plan is not None and "blocked" in plan.kinds and linear_kernel.in_graph()


def package_path(model, device_type: str, kind: str = "step") -> Path:
    return cache_root() / f"{kind}-{package_key(model, device_type, kind)}.pt2"


def write_job(lm, out: Path, kind: str = "step") -> Path:
    """The child's instructions next to ``out``: the model's class, config and dtype, its device type and the
    shape of what its layers cache (``LoadedModel.kv_shape``)."""
    build = out.with_suffix(".build")
    build.mkdir(parents=True, exist_ok=True)
    lm.model.config.save_pretrained(build)
    param = _float_param(lm.model)
    shape = lm.kv_shape
    (build / "job.json").write_text(json.dumps({
        "kind": kind, "class": type(lm.model).__name__, "dtype": str(param.dtype).replace("torch.", ""),
        "device": lm.device.type, "out": str(out), "layers": shape.num_layers,
        "attn": _attn(lm.model), "prepack": _prepack(lm.model), "native_linear": _native_linear(lm.model),
        "blocks": _blocks(lm.model),
        "k": list(shape.of("k")), "v": list(shape.of("v"))}))
    return build


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, someone else's
        return True
    return True


def running_build(out: Path) -> int | None:
    """The pid of a process building ``out`` now (its build folder names it), or None."""
    try:
        pid = int((out.with_suffix(".build") / "pid").read_text())
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) else None


def child_command(build: Path) -> list[str]:
    return [sys.executable, "-m", "engine.model.aot_build", str(build)]


def open_package(path: Path, device):
    """The package's runner, without weights yet. The first call in a process imports inductor (~2 s here), so
    it is made off the engine thread (``engine.model.fast_step``'s watcher)."""
    import torch._inductor

    from engine.model import linear_kernel, linear_op

    if device.type == "cpu" and linear_kernel.in_graph():
        linear_op.attach()  # the blocked linears' C++ kernel: ~2 us a call where the Python one costs ~17
    if device.type == "cuda":
        return torch._inductor.aoti_load_package(str(path), device_index=device.index or 0)
    return torch._inductor.aoti_load_package(str(path))


def load(runner, model):
    """``runner`` (``open_package``) fed ``model``'s own weights (no copy): a callable (ids, pos, slots, ks, vs) ->
    (logits, new ks, new vs) (the batched step's also takes ``lens`` after ``slots``). Raises with the reason when the package does not fit the model."""
    named = {f"m.{k}": v for k, v in model.named_parameters(remove_duplicate=False)}
    named.update({f"m.{k}": v for k, v in model.named_buffers(remove_duplicate=False)})
    fqns = runner.get_constant_fqns()
    missing = [f for f in fqns if f not in named]
    if missing:
        raise ValueError(f"the compiled step expects weights the model does not have: {', '.join(missing[:3])}")
    runner.load_constants({f: named[f] for f in fqns}, check_full_update=True, user_managed=True)
    return FlatCall(runner)


class FlatCall:
    """A loaded package called with its inputs already flat: (tensors..., ks, vs) -> (logits, new ks, new vs).

    The package's own ``__call__`` parses its input and output specs from JSON and walks both trees at every call
    (~0.3 ms of a ~12 ms bfloat16 SmolLM2-shape step: 60 page tensors in, 60 new K/V out); here the specs are read
    once, and checked to be that shape: leading tensors, then two lists of L tensors in, a tensor and two lists of
    L out."""

    def __init__(self, runner) -> None:
        from torch.utils import _pytree as pytree

        self.runner, self.loader = runner, runner.loader
        in_spec, out_spec = (pytree.treespec_loads(x) for x in self.loader.get_call_spec())
        args = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)[0]  # (tensor, ..., [L], [L])
        self.layers = len(args[-1])
        out = pytree.tree_unflatten(list(range(out_spec.num_leaves)), out_spec)
        ok = (len(args) >= 2 and all(isinstance(a, int) for a in args[:-2]) and len(args[-2]) == self.layers
              and len(out) == 3 and isinstance(out[0], int) and len(out[1]) == len(out[2]) == self.layers)
        if not ok:
            raise ValueError("the compiled step's inputs or outputs are not the ones this version calls it with")

    def __call__(self, *args):
        *lead, ks, vs = args
        out = self.loader.boxed_run([*lead, *ks, *vs])
        L = self.layers
        return out[0], out[1:1 + L], out[1 + L:]

    def __getattr__(self, name):
        return getattr(self.runner, name)
