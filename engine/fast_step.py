"""A compiled decode step: the model's own modules and weights, traced once by ``torch.compile`` (inductor),
reading a paged session's pages through ``engine.kv.hf_cache.StepCache``.

Why it pays: an eager decode step is hundreds of small torch ops (SmolLM2-135M: ~900 for 30 layers), each
paying its dispatch between the weight matmuls. Compiled, a layer's norms, RoPE, SiLU-mul, residual adds and
page gathers become a few fused C++ loops and the matmuls stay MKL's (or cuBLAS'). Measured on this project's
2-core machine, 1 thread, float32, decode tok/s against HF ``generate`` in the same run: stories260K 774 vs
437 (x1.77), SmolLM2-135M shape 16.8 vs 13.3 at 256 tokens (x1.27) and 11.9 vs 9.2 at 2,048 (x1.30). Where
the weight bytes bound the step (SmolLM2 reads 538 MB a token; one core reads ~10 GB/s) the gain is
smaller, and a machine may differ: so it is measured on the user's own chat before it is kept (``trial``).

Exact: the same weights and float32 ops; only the order of a few reductions may differ (greedy ids equal to
HF's, tested). Nothing is written inside the step: the new token's K/V come back and are written after it.

Lifecycle of a model's step (``LoadedModel.fast``), one owner, the worker thread (the compile runs in a
background thread and only moves ``compiling`` to ``trial`` or ``failed``):

    off        the setting says so, or this machine / model cannot compile it (``reason``)
    idle       not compiled yet: eager; ``start()`` (the app calls it once a model is loaded, the server
               when it starts) compiles in the background while the model is idle
    compiling  the compile runs (first time ~40-80 s here for SmolLM2-135M; later runs read inductor's
               on-disk cache: ~10 s); a forward asked for meanwhile waits (``no_compile_running``)
    trial      compiled: eligible steps alternate (3 compiled : 1 eager) and both are timed; again each time
               a chat's context doubles (the step copies the chat's K/V out of its pages, eager may read one
               run of pages in place: the balance moves with the length)
    on         compiled was faster: every eligible decode step uses it
    slower     compiled measured slower here: eager kept (``reason`` gives both times)
    failed     the compile or a compiled call failed (``reason``): eager from then on
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import statistics
import sys
import sysconfig
import threading
import time
import types
from itertools import count

import torch

MODES = ("auto", "on", "off")  # auto: compile and keep it where it measures faster; on: keep it regardless
TRIAL_STEPS = 32  # eligible steps of the trial: 24 compiled, 8 eager
_STEP_IDS = count()
# While inductor traces (AOT autograd, its pattern matcher), torch.fx patches ``nn.Module.__call__`` for the whole
# process: a model forward in another thread then fails ("module is not installed as a submodule", seen here).
# So the compile holds this lock, every forward of the engine takes it too (uncontended: ~0.1 us), and a forward
# asked for during a compile waits for it.
_TRACING = threading.Lock()


def no_compile_running():
    """Context for a model forward: waits while a compile traces, and keeps one from starting meanwhile."""
    return _TRACING
MIN_PAST = 2  # tokens cached before the step: a size-1 dimension would make the graph specialise (recompile)


def env_mode() -> str:
    """The mode ``KVSCOPE_FAST_STEP`` asks for (auto when unset; an unknown value is warned about, then auto)."""
    mode = os.environ.get("KVSCOPE_FAST_STEP", "auto").strip().lower()
    if mode in MODES:
        return mode
    logging.getLogger("kvscope").warning("KVSCOPE_FAST_STEP=%r is not one of %s: auto is used", mode, ", ".join(MODES))
    return "auto"


def compile_cache_dir() -> str:
    """Where inductor keeps compiled kernels between runs: ``TORCHINDUCTOR_CACHE_DIR`` if set, else the
    user's cache folder (not /tmp, which a reboot empties)."""
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "kvscope", "torch-compile")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def machine_refusal(device: torch.device) -> str:
    """Why this machine cannot compile a step for ``device`` ('' when it can)."""
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    if getattr(sys, "frozen", False):
        return "the installed app carries no compiler toolchain for torch.compile (run from source to use it)"
    if device.type == "cpu":
        if not any(shutil.which(c) for c in ("g++", "c++", "clang++", "cl")):
            return "no C++ compiler found (inductor builds the CPU step with one)"
        if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
            return "no Python headers (python3-dev): inductor's CPU kernels are built against them"
        return ""
    if device.type == "cuda":
        return "" if importlib.util.find_spec("triton") else "this build has no Triton (inductor's GPU kernels)"
    return f"torch.compile is not used on {device.type}"


def _make_step(model):
    from engine.runner import step_function

    step = step_function(model)
    # A code object of its own: dynamo keeps compiled graphs (and what their guards hold: this model) on the
    # code object, so with a shared one every model ever loaded would stay in memory and share its limit of 8
    # graphs; this way a model's graph goes with its FastStep.
    code = step.__code__.replace(co_name=f"kvscope_step_{next(_STEP_IDS)}")
    return types.FunctionType(code, step.__globals__, code.co_name, None, step.__closure__)


class FastStep:
    """The compiled decode step of one loaded model, its state and its measurements (see the module doc)."""

    def __init__(self, lm, mode: str | None = None) -> None:
        self.lm = lm
        self.mode = mode if mode is not None else env_mode()
        self.state, self.reason = "idle", ""
        self.compile_s = 0.0
        self.calls = {"compiled": 0, "eager": 0}
        self._times: dict[str, list[float]] = {"compiled": [], "eager": []}
        self._trial_at = 0  # context length (tokens) when the last trial began
        self._fn = None
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self.on_change = None  # fn(describe()) when a compile starts or ends (called from the compile thread)
        self._refresh()

    # -- setting ---------------------------------------------------------------------------------------
    def set_mode(self, mode: str) -> None:
        """``auto`` / ``on`` / ``off`` from now on (a compiled step is kept: turning it back on is instant)."""
        if mode not in MODES:
            raise ValueError(f"fast step: {mode!r} is not one of {', '.join(MODES)}")
        self.mode = mode
        self._refresh()

    def _refresh(self) -> None:
        if self.state == "compiling":
            return  # the compile thread ends it
        if self.mode == "off":
            self.state, self.reason = "off", "turned off in the settings"
            return
        why = self.model_refusal()
        if why:
            self.state, self.reason = "off", why
        elif self._fn is not None:
            self.state, self.reason = ("on" if self.mode == "on" else "trial"), ""
            self._times = {"compiled": [], "eager": []}
        elif self.state in ("off", "slower"):
            self.state, self.reason = "idle", ""

    def model_refusal(self) -> str:
        info = self.lm.info
        if getattr(info, "attn_impl", "sdpa") != "sdpa":
            return f"the model runs {info.attn_impl} attention (the step is built on sdpa)"
        kinds = set(getattr(info, "layer_kinds", ()) or ())
        if kinds - {"full"}:
            return f"the model's layers differ ({', '.join(sorted(kinds - {'full'}))}): the step reads one paged cache"
        if getattr(info, "quantization", "none") not in ("none", "", None):
            return "bitsandbytes weights (their kernels do not compile)"
        return machine_refusal(self.lm.device)

    # -- per step --------------------------------------------------------------------------------------
    def refusal(self, store, scores: bool = False) -> str:
        """Why a one-token forward over ``store`` cannot be the compiled step ('' when it can, once compiled);
        ``scores``: the sequence's policy reads attention scores."""
        from engine.kv.storage import PagedKV

        if type(store) is not PagedKV:
            return "the step reads a plain paged cache (this chat is not on one)"
        if store.arena.quantized:
            return "K/V pages are int8/int4"
        if scores:
            return "the policy reads attention scores"
        return ""

    def choose(self, store, scores: bool = False) -> str:
        """"compiled" or "eager" for a one-token forward over ``store``."""
        if self.state in ("off", "failed", "idle", "compiling") or self.refusal(store, scores):
            return "eager"
        if store.past_len < MIN_PAST:
            return "eager"
        n = store.past_len
        if self.state in ("on", "slower") and self.mode == "auto" and n >= 2 * max(self._trial_at, 128):
            self._begin_trial(n)  # the context doubled: gathers grow with it, so measure again
            if self.state == "trial":
                return "compiled"
        if self.state == "slower":
            return "eager"
        if self.state == "trial" and sum(self.calls.values()) % 4 == 3:
            return "eager"
        return "compiled"

    def _begin_trial(self, n: int) -> None:
        self.state, self._trial_at, self.reason = "trial", n, f"again at {n} tokens (the context doubled)"
        self._times = {"compiled": [], "eager": []}

    def record(self, path: str, ms: float) -> None:
        """The time of an eligible step's forward; the trial ends after ``TRIAL_STEPS`` of them."""
        self.calls[path] = self.calls.get(path, 0) + 1
        if self.state != "trial":
            return
        self._times[path].append(ms)
        c, e = self._times["compiled"], self._times["eager"]
        if len(c) + len(e) < TRIAL_STEPS or not c or not e:
            return
        mc, me = statistics.median(c), statistics.median(e)
        if mc < me:
            self.state, self.reason = "on", f"compiled {mc:.1f} ms vs eager {me:.1f} ms a step (measured)"
        else:
            self.state, self.reason = "slower", f"compiled {mc:.1f} ms vs eager {me:.1f} ms a step: eager kept"

    def forward(self, store, token: int, rope: int):
        """The compiled forward of one token over ``store`` (room reserved by the caller): the logits [vocab],
        the new K/V written to the pages. Raises on failure; the pages are then untouched."""
        dev = self.lm.device
        arena, n = store.arena, store.past_len
        P, pages = arena.page_size, store.table.pages
        page_t = torch.tensor(pages[:-(-n // P)], dtype=torch.long, device=dev)  # [n_pages]
        slots = (page_t[:, None] * P + torch.arange(P, device=dev)).reshape(-1)[:n]  # [n] slot of each token
        ids = torch.tensor([[token]], dtype=torch.long, device=dev)  # [1, 1]
        pos = torch.tensor([[rope]], dtype=torch.long, device=dev)  # [1, 1]
        ks, vs = arena.roles["k"].layers, arena.roles["v"].layers
        with torch.compiler.set_stance("fail_on_recompile"), torch.inference_mode():
            logits, nk, nv = self._fn(ids, pos, slots, ks, vs)
        slot = pages[n // P] * P + n % P
        with torch.inference_mode():
            for t, x in zip(ks + vs, nk + nv):
                t[:, slot].copy_(x[0, :, 0])  # [H, D] into the token's slot
        return logits

    def fail(self, exc: BaseException) -> None:
        """A compiled call failed: eager from now on, with the reason."""
        self.state, self.reason = "failed", f"a compiled step failed: {type(exc).__name__}: {exc}"[:300]

    # -- compile ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Compile in a background thread (no-op unless idle). Call it while the model is idle (after a load,
        after a reply): forwards wait while it traces."""
        if self.state != "idle":
            return
        self.state, self._done = "compiling", threading.Event()
        self._thread = threading.Thread(target=self._compile, name="kvscope-compile", daemon=True)
        self._thread.start()
        self._notify()

    def _notify(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change(self.describe())
            except Exception:  # noqa: BLE001 - a listener's trouble never stops the compile
                pass

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a started compile ends (True), or ``timeout`` seconds pass (False)."""
        if self.state != "compiling":
            return True
        return self._done.wait(timeout)

    def _compile(self) -> None:
        t0 = time.perf_counter()
        with _TRACING:  # the state changes before the lock goes: the forwards that waited find it ready
            try:
                compile_cache_dir()
                fn = torch.compile(_make_step(self.lm.model), dynamic=False)
                self._warm(fn)
            except BaseException as e:  # noqa: BLE001 - any failure leaves the eager path, with the reason
                self.state, self.reason = "failed", f"compiling the step failed: {type(e).__name__}: {e}"[:300]
            else:
                self._fn = fn
                self.compile_s = time.perf_counter() - t0
                self.state, self.reason = ("on" if self.mode == "on" else "trial"), ""
                if self.mode == "off":
                    self.state, self.reason = "off", "turned off in the settings"
            finally:
                self._done.set()
        self._notify()

    def _warm(self, fn) -> None:
        """One call on scratch tensors of the model's shapes: the lengths marked dynamic, so one graph serves
        every context length and page size."""
        shape, dev, P = self.lm.kv_shape, self.lm.device, 16
        (hk, dk), (hv, dv) = shape.of("k"), shape.of("v")
        ks = [torch.zeros((hk, 4 * P, dk), dtype=shape.dtype, device=dev) for _ in range(shape.num_layers)]
        vs = [torch.zeros((hv, 4 * P, dv), dtype=shape.dtype, device=dev) for _ in range(shape.num_layers)]
        slots = torch.arange(2 * P, device=dev)  # [32]
        for t in ks + vs:
            torch._dynamo.mark_dynamic(t, 1)
        torch._dynamo.mark_dynamic(slots, 0)
        ids = torch.zeros((1, 1), dtype=torch.long, device=dev)
        pos = torch.full((1, 1), 2 * P, dtype=torch.long, device=dev)
        with torch.inference_mode():
            fn(ids, pos, slots, ks, vs)

    def describe(self) -> str:
        """One line for the model card / timing caption."""
        text = {"off": "off", "idle": "not compiled yet", "compiling": "compiling in the background",
                "trial": "compiled, measuring against eager", "on": "compiled step in use",
                "slower": "eager (compiled measured slower)", "failed": "eager (compile failed)"}[self.state]
        return f"{text} — {self.reason}" if self.reason else text
