"""A compiled decode step: the model's own modules and weights, exported and compiled ahead of time by
AOTInductor in a child process (``engine.model.aot_step``), reading a paged sequence's pages through
``engine.kv.hf_cache.StepCache``; ``engine.model.runner.ModelRunner`` runs it.

Why it pays: an eager decode step is hundreds of small torch ops (SmolLM2-135M: ~900 for 30 layers), each
paying its dispatch between the weight matmuls. Compiled, a layer's norms, RoPE, SiLU-mul, residual adds and
page gathers become a few fused C++ loops and the matmuls stay MKL's (or cuBLAS'). Where the weight bytes bound
the step the gain is smaller, and a machine may differ: so it is measured on the user's own chat before it is
kept (``trial``).

Exact: the same weights and float32 ops; only the order of a few reductions may differ (greedy ids equal to
HF's, tested). Nothing is written inside the step: the new token's K/V come back and are written after it.

Compiling never blocks a reply: the child process builds the package while replies run eager, and the engine
thread switches between two tokens once it is there (``poll``). Nothing in this process traces, so no forward
waits for anything. The package is kept per model shape in the user's cache folder (``engine.model.aot_step``):
the next launch loads it in milliseconds.

Lifecycle of a model's step (``ModelRunner.fast``). One owner, the engine thread: the watcher thread only
notes that the child ended and wakes the engine (``waker``).

    off        the setting says so, or this machine / model cannot compile it (``reason``)
    idle       not built yet: eager; ``start()`` loads the cached package, or starts the child
    compiling  the child builds it (SmolLM2-135M: minutes on 2 cores, at low priority); eager meanwhile
    trial      loaded: eligible steps alternate (3 compiled : 1 eager) and both are timed; again each time a
               chat's context doubles (the step copies the chat's K/V out of its pages, eager may read one run
               of pages in place: the balance moves with the length)
    on         compiled was faster: every eligible decode step uses it
    slower     compiled measured slower here: eager kept (``reason`` gives both times)
    failed     the build or a compiled call failed (``reason``): eager from then on
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import torch

from engine.kv.store import paged_decode  # noqa: F401 - defines kvscope::write_slot
from engine.model import aot_step, linear_op

MODES = ("auto", "on", "off")  # auto: compile and keep it where it measures faster; on: keep it regardless
TRIAL_STEPS = 32  # eligible steps of the trial: 24 compiled, 8 eager
# ... or fewer where the answer is plain: from EARLY_STEPS on (6 compiled, 2 eager) the trial ends once the compiled
# steps' median is under CLEAR x the fastest eager step. Each eager step of a trial is a slower token of the chat
# (1B-shape Q4_K_M, two threads: 23.7 ms against 15.7), and a trial runs at a chat's start and each time its context
# doubles: six fewer of them, ~50 ms a trial there (the first 64 tokens ~5% faster).
EARLY_STEPS = 8
CLEAR = 0.8
BUILD_TIMEOUT_S = 1800.0  # a build still running after this (a hung compiler) is stopped: eager, with the reason
MIN_PAST = aot_step.MIN_LEN  # tokens cached before the step (the package's dynamic lengths start there)


def env_mode() -> str:
    """The mode ``KVSCOPE_FAST_STEP`` asks for (auto when unset; an unknown value is warned about, then auto)."""
    mode = os.environ.get("KVSCOPE_FAST_STEP", "auto").strip().lower()
    if mode in MODES:
        return mode
    logging.getLogger("kvscope").warning("KVSCOPE_FAST_STEP=%r is not one of %s: auto is used", mode, ", ".join(MODES))
    return "auto"


def compile_cache_dir() -> str:
    """Where inductor keeps compiled kernels between runs (``engine`` sets it at import: ``aot_step``)."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or aot_step.inductor_cache_dir()


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


class FastStep:
    """The compiled decode step of one loaded model, its state and its measurements (see the module doc). It owns
    the model's compiled batched step (``batch``, ``engine.model.fast_batch``, given by the runner): the same
    setting, built after it."""

    kind = "step"  # which package (``aot_step.KINDS``)
    per = "a step"  # what a trial's time is of

    def __init__(self, lm, mode: str | None = None) -> None:
        self.lm = lm
        self.mode = mode if mode is not None else env_mode()
        self.state, self.reason = "idle", ""
        self.compile_s = 0.0  # the child's build time (0: loaded from the cache)
        self.package: Path | None = None  # where the package is (or will be)
        self.calls = {"compiled": 0, "eager": 0}
        self._times: dict[str, list[float]] = {"compiled": [], "eager": []}
        self._trial_at = 0  # context length (tokens) when the last trial began
        self.trial_steps = 0  # eligible steps the last trial ended after (EARLY_STEPS..TRIAL_STEPS)
        self._fn = None
        self._slot_key, self._slot_t = None, None  # the last step's pages and their slots (``_slots``)
        self._proc: subprocess.Popen | None = None
        self._t_start = 0.0
        self._built = threading.Event()  # the package is open, or will not be (set by the watcher thread)
        self._opened = None  # the package's runner, opened by the watcher (``aot_step.open_package``)
        self._open_error = ""
        self.on_change = None  # fn(describe()) when a build starts or ends (engine thread)
        self.waker = None  # fn() the watcher calls when the child ends, so the engine thread polls soon
        self._refresh()
        self.batch = None  # the compiled batched step (``engine.model.fast_batch``): the runner gives it one

    # -- setting ---------------------------------------------------------------------------------------
    def set_mode(self, mode: str) -> None:
        """``auto`` / ``on`` / ``off`` from now on (a loaded step is kept: turning it back on is instant)."""
        if mode not in MODES:
            raise ValueError(f"fast step: {mode!r} is not one of {', '.join(MODES)}")
        self.mode = mode
        self._refresh()
        if self.batch is not None:
            self.batch.set_mode(mode)

    def _refresh(self) -> None:
        if self.state == "compiling":
            return  # ``poll`` ends it
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
            if any(type(m).__module__.startswith("bitsandbytes") for m in self.lm.model.modules()):
                return "bitsandbytes weights (their kernels do not compile)"
            if not getattr(self.lm.model, "kvscope_block_plan", None):
                return "the quantized weights have no block plan for the step's build"
        return machine_refusal(self.lm.device)

    # -- per step --------------------------------------------------------------------------------------
    def refusal(self, store, scores: bool = False) -> str:
        """Why a one-token forward over ``store`` cannot be the compiled step ('' when it can, once compiled);
        ``scores``: the sequence's policy reads attention scores."""
        from engine.kv.store.storage import PagedKV

        if type(store) is not PagedKV:
            return "the step reads a plain paged cache (this chat is not on one)"
        if store.arena.quantized:
            return "K/V pages are quantized (int8 / int4 / tq)"
        if scores:
            return "the policy reads attention scores"
        return ""

    def choose(self, store, scores: bool = False) -> str:
        """"compiled" or "eager" for a one-token forward over ``store`` (a finished build is taken up here)."""
        if self.state == "compiling":
            self.poll()
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
        """The time of an eligible step's forward; the trial ends after ``TRIAL_STEPS`` of them, or from
        ``EARLY_STEPS`` on where compiled is plainly faster (``CLEAR``)."""
        self.calls[path] = self.calls.get(path, 0) + 1
        if self.state != "trial":
            return
        self._times[path].append(ms)
        c, e = self._times["compiled"], self._times["eager"]
        n = len(c) + len(e)
        if n < EARLY_STEPS or not c or not e:
            return
        if n < TRIAL_STEPS and not statistics.median(c) < CLEAR * min(e):
            return
        self.trial_steps = n
        mc, me = statistics.median(c), statistics.median(e)
        if mc < me:
            self.state, self.reason = "on", f"compiled {mc:.1f} ms vs eager {me:.1f} ms {self.per} (measured)"
        else:
            self.state, self.reason = "slower", f"compiled {mc:.1f} ms vs eager {me:.1f} ms {self.per}: eager kept"

    def forward(self, store, token: int, rope: int):
        """The compiled forward of one token over ``store`` (room reserved by the caller): the logits [vocab],
        the new K/V written to the pages. Raises on failure; the pages are then untouched."""
        dev = self.lm.device
        arena, n = store.arena, store.past_len
        P, pages = arena.page_size, store.table.pages
        slots = self._slots(tuple(pages[:-(-n // P)]), P, dev)[:n]  # [n] slot of each token
        ids = torch.tensor([[token]], dtype=torch.long, device=dev)  # [1, 1]
        pos = torch.tensor([[rope]], dtype=torch.long, device=dev)  # [1, 1]
        ks, vs = arena.roles["k"].layers, arena.roles["v"].layers
        with torch.inference_mode():
            logits, nk, nv = self._fn(ids, pos, slots, ks, vs)
            slot = pages[n // P] * P + n % P
            if linear_op.loaded():  # the C++ kernel: one call (~50 us here, where the loop below takes ~350)
                torch.ops.kvscope.write_slot(ks + vs, nk + nv, slot)
            else:
                for t, x in zip(ks + vs, nk + nv):
                    t[:, slot].copy_(x[0, :, 0])  # [H, D] into the token's slot
        return logits

    def _slots(self, pages: tuple[int, ...], P: int, dev) -> torch.Tensor:
        """[len(pages) * P] the slots of these pages' tokens, in order: made again only when the pages differ from the
        last step's (a new page every P tokens, another chat, a table rewritten), not each token (~20 us of tensors)."""
        key = (pages, P, dev)
        if self._slot_key != key:
            page_t = torch.tensor(pages, dtype=torch.long, device=dev)  # [n_pages]
            self._slot_t = (page_t[:, None] * P + torch.arange(P, device=dev)).reshape(-1)  # [n_pages * P]
            self._slot_key = key
        return self._slot_t

    def fail(self, exc: BaseException) -> None:
        """A compiled call failed: eager from now on, with the reason."""
        self.state, self.reason = "failed", f"a compiled step failed: {type(exc).__name__}: {exc}"[:300]

    # -- build -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Engine thread, no-op unless idle: open the cached package, or start the child that builds it, in the
        background (replies run eager meanwhile; ``poll`` takes it up between two steps)."""
        if self.state != "idle":
            return
        log, other = None, None
        try:
            self.package = aot_step.package_path(self.lm.model, self.lm.device.type, self.kind)
            self._proc = None
            other = aot_step.running_build(self.package)  # another process builds it now: wait for its package
            if not self.package.exists() and other is None:
                log, self._proc = self._spawn()
        except Exception as e:  # noqa: BLE001 - the eager path answers; the reason is kept and shown
            self.state, self.reason = "failed", f"could not start the compile: {type(e).__name__}: {e}"[:300]
            self._notify()
            return
        self.state, self._t_start, self._built = "compiling", time.perf_counter(), threading.Event()
        self._opened, self._open_error = None, ""
        threading.Thread(target=self._watch, args=(self._proc, log, self._built, other), daemon=True,
                         name="kvscope-compile-watch").start()
        self._notify()

    def _spawn(self):
        """The child that builds the package (``engine.model.aot_build``): (its log file, the process)."""
        self.package.parent.mkdir(parents=True, exist_ok=True)
        build = aot_step.write_job(self.lm, self.package, self.kind)
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=compile_cache_dir(),
                   PYTHONPATH=os.pathsep.join(p for p in [str(Path(__file__).resolve().parents[2]),
                                                          os.environ.get("PYTHONPATH", "")] if p))
        log = open(build / "log.txt", "wb")  # noqa: SIM115 - the child writes it; closed by the watcher
        proc = subprocess.Popen(aot_step.child_command(build), stdout=log, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL)
        (build / "pid").write_text(str(proc.pid))
        return log, proc

    def _watch(self, proc: subprocess.Popen | None, log, built: threading.Event, other: int | None) -> None:
        """Watcher thread: wait for the child (or another process's build), open the package (no forward, no
        weights), then wake the engine thread, which takes it up (``poll``)."""
        if proc is not None:
            try:
                proc.wait(BUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                self._open_error = f"compiling the step took over {BUILD_TIMEOUT_S:.0f} s and was stopped"
            log.close()
        while other is not None and not self.package.exists() and aot_step.pid_alive(other):
            time.sleep(0.5)
        if (proc is None or proc.returncode == 0) and self.package.exists():
            if proc is not None:
                shutil.rmtree(self.package.with_suffix(".build"), ignore_errors=True)  # built: only the package stays
            try:
                self._opened = aot_step.open_package(self.package, self.lm.device)
            except Exception as e:  # noqa: BLE001 - told by ``poll``
                self._open_error = f"opening the compiled step failed: {type(e).__name__}: {e}"
                self.package.unlink(missing_ok=True)  # built again next time
        elif proc is not None and not self._open_error:
            self._open_error = f"compiling the step failed: {self._child_reason()}"
        built.set()
        if self.waker is not None:
            try:
                self.waker()
            except Exception:  # noqa: BLE001 - the next step polls anyway
                pass

    def start_batch(self) -> None:
        """Engine thread, when several sequences decode together: open or build the batched step (``batch``),
        unless this step's own build runs (two builds on a small machine would each take twice as long)."""
        b = self.batch
        if b is None or b.state != "idle" or self.state in ("idle", "compiling"):
            return  # idle: nobody asked for compiled steps (the owner starts this one first)
        b.waker, b.on_change = self.waker, (lambda _text: self._notify())
        b.start()

    def poll(self) -> None:
        """Engine thread: if the child has ended, load its package (or keep the reason it failed)."""
        if self.batch is not None:
            self.batch.poll()
        if self.state != "compiling" or not self._built.is_set():
            return
        proc, self._proc = self._proc, None
        self.compile_s = time.perf_counter() - self._t_start if proc is not None else 0.0
        opened, self._opened = self._opened, None
        if opened is not None:
            self._install(opened)
            return
        self.state, self.reason = "failed", (self._open_error or "the compile ended without a package")[:300]
        self._notify()

    def _child_reason(self) -> str:
        log = self.package.with_suffix(".build") / "log.txt" if self.package is not None else None
        try:
            lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log else []
        except OSError:
            lines = []
        return lines[-1] if lines else "the compile process ended without a package"

    def _install(self, opened) -> None:
        try:
            self._fn = aot_step.load(opened, self.lm.model)
        except Exception as e:  # noqa: BLE001 - a package that does not fit is dropped and built again next time
            self.state, self.reason = "failed", f"loading the compiled step failed: {type(e).__name__}: {e}"[:300]
            self.package.unlink(missing_ok=True)
            self._notify()
            return
        self.state, self.reason = ("on" if self.mode == "on" else "trial"), ""
        if self.mode == "off":
            self.state, self.reason = "off", "turned off in the settings"
        self._notify()

    def _notify(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change(self.describe())
            except Exception:  # noqa: BLE001 - a listener's trouble never stops the engine
                pass

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a started build ends and take it up (True), or ``timeout`` seconds pass (False). For the
        engine thread (tests, the bench): nothing else runs meanwhile."""
        if self.state != "compiling":
            return True
        if not self._built.wait(timeout):
            return False
        self.poll()
        return True

    def close(self) -> None:
        """Stop a build in flight (the model is going away)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
        if self.batch is not None:
            self.batch.close()

    def describe(self) -> str:
        """One line for the model card / timing caption."""
        text = {"off": "off", "idle": "not compiled yet", "compiling": "compiling in the background",
                "trial": "compiled, measuring against eager", "on": "compiled step in use",
                "slower": "eager (compiled measured slower)", "failed": "eager (compile failed)"}[self.state]
        text = f"{text} — {self.reason}" if self.reason else text
        b = self.batch
        if b is not None and b.state not in ("idle", "off"):  # several chats decoded together at least once
            text += f"; several chats at once: {b.describe()}"
        return text
