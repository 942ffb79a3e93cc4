"""The script PyInstaller freezes into the ``kvscope`` executable (see kvscope.spec).

It does three things the app itself should not have to know about:

* ``multiprocessing.freeze_support()`` first, so a frozen child process (torch DataLoader workers,
  pyqtgraph's multiprocess helpers) runs its task instead of a second copy of the app;
* in a Windows *windowed* build ``sys.stdout``/``sys.stderr`` are ``None``: they are pointed at a log file
  (``%TEMP%\\kvscope.log``, or ``$KVSCOPE_LOG``) so that prints and ``--self-test`` output do not crash;
* ``kvscope --bundle-check [--model DIR] [--gguf FILE] [--json FILE]``: a packaging probe that is independent of the app's
  GUI. It proves, inside the frozen bundle, what the installer needs: resources are found via
  ``sys._MEIPASS``, torch and bitsandbytes load their native libraries, transformers' lazily imported
  model classes for every architecture in ``ARCHITECTURES`` build and generate through the engine's paged
  KV cache, the shipped stories260K (the app's default model) loads from the bundle's own ``resources/`` and
  writes its known greedy story, (with ``--model``) a real checkpoint loads in float32 and bitsandbytes NF4, and
  (with ``--gguf``) a GGUF file loads through transformers' GGUF support.

Everything else goes to ``app.main:main`` (``KVSCOPE_APP_MODULE`` at build time can name another module
with a ``main(argv=None, t0=None)``; packaging/README.md explains why that exists).

Keep the module importable without torch or Qt: kvscope.spec imports ``ARCHITECTURES`` from it.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()

import os  # noqa: E402
import sys  # noqa: E402

# Architectures the bundle is verified with, one of each layer kind the engine handles (full attention;
# sliding windows: gemma3_text, and gpt_oss with learned sinks on eager attention; short-convolution state:
# lfm2). The frozen --bundle-check builds and runs each; kvscope.spec adds their transformers packages as
# hidden imports. (model_type, tokenizer class names that configs name for it)
ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "llama": ("LlamaTokenizer", "LlamaTokenizerFast"),
    "mistral": ("LlamaTokenizer", "TokenizersBackend"),
    "qwen2": ("Qwen2Tokenizer", "Qwen2TokenizerFast"),
    "qwen3": ("Qwen2Tokenizer",),
    "phi3": ("LlamaTokenizer", "TokenizersBackend"),
    "gemma": ("GemmaTokenizer", "GemmaTokenizerFast"),
    "gemma3_text": ("GemmaTokenizer",),
    "gpt_oss": ("TokenizersBackend",),
    "lfm2": ("TokenizersBackend",),
}
# What a tiny config of these needs beyond the common sizes: windows shorter than the check's reply, so the
# sliding pages really go back to the pool; every kind of layer present.
_LAYERS = {
    "gemma3_text": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "gpt_oss": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"], num_local_experts=2,
                    num_experts_per_tok=1),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
}

# The module whose main() runs the app; kvscope.spec rewrites this line in its build copy when
# KVSCOPE_APP_MODULE is set (development builds only).
APP_MODULE = "app.main"


def bundle_root() -> str:
    """Where the bundle's files are: ``sys._MEIPASS`` frozen, the source tree otherwise."""
    if getattr(sys, "frozen", False):
        return getattr(sys, "_MEIPASS", os.path.dirname(sys.executable))
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _process_start_t0() -> float:
    """``time.perf_counter()`` at the moment the process started (Linux: from /proc; else at this
    module's import), so the app's "time to visible window" includes the bootloader and interpreter start."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, ticks after boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
        if 0.0 <= age < 120.0:
            return time.perf_counter() - age
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    return _T0


def _fix_windowed_streams() -> None:
    if sys.stdout is not None and sys.stderr is not None:
        return
    import tempfile

    path = os.environ.get("KVSCOPE_LOG") or os.path.join(tempfile.gettempdir(), "kvscope.log")
    try:
        log = open(path, "a", encoding="utf-8", buffering=1)
    except OSError:
        log = open(os.devnull, "w", encoding="utf-8")
    if sys.stdout is None:
        sys.stdout = log
    if sys.stderr is None:
        sys.stderr = log


# -- bundle check ------------------------------------------------------------------------------------------
def _tiny_config(arch: str):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(
        arch, vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **_LAYERS.get(arch, {}),
    )
    return cfg


def _run_session(lm, prompt_ids=None, prompt: str | None = None, new_tokens: int = 6) -> list[int]:
    from engine.config import CacheConfig, SamplingConfig
    from engine.core.session import ChatSession

    out: list[list[int]] = []
    for mode in ("off", "paged"):
        s = ChatSession(lm, CacheConfig(mode=mode, page_size=4))
        sampling = SamplingConfig(max_new_tokens=new_tokens, ignore_eos=True)
        if prompt is not None:
            s.start_completion(prompt, sampling)
        else:
            s.start_ids(prompt_ids, sampling)
        while not s.step().done:
            pass
        ids = s.generated_ids() if callable(s.generated_ids) else s.generated_ids
        out.append([int(i) for i in ids])
        s.close()
    if out[0] != out[1]:
        raise AssertionError(f"cache off and paged disagree: {out[0]} vs {out[1]}")
    return out[1]


def _native_check() -> dict:
    """The native kernels as a machine without a compiler has them (CC / CXX pointed at ``false``, an empty cache): on
    x86-64 Linux each must load from the bundle's prebuilt levels (``engine.native.prebuild``), else this fails naming
    what is missing. Runs before any model loads, so the checks after it run on these libraries."""
    import platform
    import tempfile

    keep = {k: os.environ.get(k) for k in ("CC", "CXX", "XDG_CACHE_HOME")}
    os.environ.update(CC="false", CXX="false", XDG_CACHE_HOME=tempfile.mkdtemp(prefix="kvscope-native-"))
    try:
        from engine.kv.quantized import native
        from engine.model import linear_kernel, linear_op
        from engine.native import build
        from engine.quant import kernel

        native.library(), linear_kernel.LINEAR.library(), linear_op.attach(), kernel.library()
        found = {r["library"]: r["origin"] or f"missing ({r['why']})" for r in build.report()}
    finally:
        for k, v in keep.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    lost = sorted(k for k, v in found.items() if not v.startswith("prebuilt "))
    if lost and sys.platform == "linux" and platform.machine() == "x86_64":
        raise RuntimeError(f"native kernels not prebuilt in the bundle: {', '.join(lost)} ({found})")
    return found


def _native_speed() -> dict:
    """Decode tokens/s of a SmolLM2-135M-shape float32 chat (random weights, 128-token prompt, 32 new tokens, one
    thread) with the native kernels and with KVSCOPE_NATIVE=off, sides interleaved, median of three each."""
    import statistics

    import torch

    from engine.config import CacheConfig, SamplingConfig
    from engine.core.session import ChatSession
    from engine.model.shapes import build_shape

    torch.set_num_threads(1)
    lm, runs = build_shape("smollm2-135m"), {"on": [], "off": []}
    prompt = torch.randint(3, 40000, (128,), generator=torch.Generator().manual_seed(1)).tolist()
    for i in range(6):
        side = ("on", "off")[i % 2]
        os.environ["KVSCOPE_NATIVE"] = side
        for kv in ("auto", "tq4"):
            s = ChatSession(lm, CacheConfig(mode="paged", page_size=16, k_dtype=kv, v_dtype=kv))
            s.start_ids(prompt, SamplingConfig(max_new_tokens=33, ignore_eos=True))
            s.step()
            t = time.perf_counter()
            while not s.step().done:
                pass
            runs[side].append((kv, 32 / (time.perf_counter() - t)))
            s.close()
    os.environ.pop("KVSCOPE_NATIVE")
    return {f"{kv} {side}": round(statistics.median(r for k, r in runs[side] if k == kv), 2)
            for side in runs for kv in ("auto", "tq4")}


def bundle_check(argv: list[str]) -> int:
    import argparse
    import importlib.util
    import json
    import traceback

    p = argparse.ArgumentParser(prog="kvscope --bundle-check")
    p.add_argument("--model", default=None, help="a local model folder to load in float32 and nf4")
    p.add_argument("--gguf", default=None, help="a GGUF file to load through transformers' GGUF support")
    p.add_argument("--json", default=None, help="write the results here as JSON")
    p.add_argument("--no-gui", action="store_true", help="skip the Qt/pyqtgraph check")
    p.add_argument("--speed", action="store_true", help="also time decoding with the native kernels and without")
    args = p.parse_args(argv)
    results: dict = {"frozen": bool(getattr(sys, "frozen", False)), "root": bundle_root()}
    failures: list[str] = []

    def check(name, fn):
        t = time.perf_counter()
        try:
            results[name] = fn()
            status = "ok"
        except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the others
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            failures.append(name)
            status = "FAIL"
            traceback.print_exc()
        print(f"[{status}] {name} ({time.perf_counter() - t:.2f} s): {json.dumps(results[name])[:300]}",
              flush=True)

    def resources():
        res = os.path.join(bundle_root(), "resources")
        if not os.path.isdir(res):
            raise FileNotFoundError(f"no resources folder at {res}")
        files = sorted(os.path.relpath(os.path.join(d, f), res) for d, _, fs in os.walk(res) for f in fs)
        if not files:
            raise FileNotFoundError(f"{res} is empty")
        # the app's own way: <package>/../resources, which PyInstaller maps under sys._MEIPASS too
        import engine

        via_file = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(engine.__file__))), "resources")
        if os.path.realpath(via_file) != os.path.realpath(res):
            raise FileNotFoundError(f"Path(engine.__file__).parent.parent / 'resources' is {via_file}, not {res}")
        return {"dir": res, "files": len(files), "sample": files[:8]}

    def torch_check():
        import torch

        x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        return {"version": torch.__version__, "cuda": torch.version.cuda, "threads": torch.get_num_threads(),
                "matmul": float((x @ x.T).sum())}

    def bnb_check():
        import bitsandbytes
        import bitsandbytes.functional as F

        lib = type(F.lib).__name__
        if lib != "BNBNativeLibrary":  # the CPU/CUDA library did not load: bnb silently changed code path
            raise RuntimeError(f"bitsandbytes native library not loaded ({lib})")
        if importlib.util.find_spec("kernels") is not None:
            raise RuntimeError("the 'kernels' package is bundled: bitsandbytes would fetch kernels from the hub")
        return {"version": bitsandbytes.__version__, "lib": lib}

    def gui_check():
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
        import pyqtgraph as pg
        from PySide6.QtWidgets import QApplication

        app = QApplication.instance() or QApplication(sys.argv[:1])
        w = pg.PlotWidget()
        w.plot([0, 1, 2], [1, 3, 2])
        w.resize(200, 120)
        w.show()
        app.processEvents()
        img = w.grab().toImage()
        w.close()
        out = {"platform": app.platformName(), "grab": [img.width(), img.height()], "pyqtgraph": pg.__version__}
        try:
            from app.shell.resources import app_icon  # the app's own resource lookup, when it has one
        except ImportError:
            return out
        icon = app_icon()
        if icon.isNull():
            raise FileNotFoundError("app.shell.resources.app_icon() found no icon files in the bundle")
        out["app_icon_sizes"] = [s.width() for s in icon.availableSizes()]
        return out

    def arch_check(arch: str, tok_names: tuple[str, ...]):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

        from engine.config import ModelSpec
        from engine.model.loaded import wrap_model

        cfg = _tiny_config(arch)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            try:
                model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
            except ValueError:  # no sdpa for this class (gpt-oss's sinks)
                model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
        model.generation_config.eos_token_id = None
        lm = wrap_model(model, None, ModelSpec(source=f"bundle-check:{arch}", device="cpu"), "cpu", "cpu",
                        name=arch, path=None, is_demo=True)
        ids = _run_session(lm, prompt_ids=[1, 5, 7, 9, 11])
        kinds = lm.info.layer_summary
        toks = {}
        for n in tok_names:
            cls = tokenizer_class_from_name(n)
            if cls is None:
                raise ImportError(f"tokenizer class {n} not found")
            toks[n] = cls.__module__
        return {"model": type(model).__name__, "layers": kinds, "ids": ids, "tokenizers": toks}

    def demo_check():
        from engine.model.loader import load_model

        lm = load_model("demo")
        return {"name": lm.info.name, "ids": _run_session(lm, prompt="Once upon a time")}

    def builtin_check():
        from engine.model.builtin import BUILTIN_MODEL, builtin_model_dir
        from engine.model.loader import load_model

        folder = builtin_model_dir()
        root = folder.parent.parent.parent  # <root>/resources/models/stories260K
        if os.path.realpath(root) != os.path.realpath(bundle_root()):
            raise FileNotFoundError(f"the built-in model resolved to {folder}, outside the bundle {bundle_root()}")
        lm = load_model(BUILTIN_MODEL)
        ids = _run_session(lm, prompt="Once upon a time", new_tokens=12)
        return {"name": lm.info.name, "path": str(folder), "ids": ids, "text": lm.tokenizer.decode(ids)}

    def model_check(quantization: str, source: str | None = None):
        from engine.config import ModelSpec
        from engine.model.loader import load_model

        lm = load_model(ModelSpec(source=source or args.model, quantization=quantization, device="cpu",
                                  allow_download=False))
        ids = _run_session(lm, prompt="Once upon a time", new_tokens=12)
        return {"name": lm.info.name, "architecture": lm.info.architecture, "ids": ids,
                "text": lm.tokenizer.decode(ids)}

    check("resources", resources)
    check("torch", torch_check)
    check("native_kernels", _native_check)
    if args.speed:
        check("native_speed", _native_speed)
    check("bitsandbytes", bnb_check)
    if not args.no_gui:
        check("gui", gui_check)
    check("demo", demo_check)
    check("builtin", builtin_check)
    for arch, toks in ARCHITECTURES.items():
        check(f"arch:{arch}", lambda a=arch, t=toks: arch_check(a, t))
    if args.model:
        check("model:float32", lambda: model_check("none"))
        check("model:nf4", lambda: model_check("nf4"))
    if args.gguf:  # the gguf package and transformers' lazily imported GGUF loader are in the bundle
        check("gguf:float32", lambda: model_check("none", args.gguf))
    results["failures"] = failures
    results["seconds"] = round(time.perf_counter() - _T0, 2)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    print(f"bundle-check {'OK' if not failures else 'FAILED: ' + ', '.join(failures)} "
          f"({results['seconds']} s)", flush=True)
    return 0 if not failures else 1


def main() -> int:
    import multiprocessing

    multiprocessing.freeze_support()
    _fix_windowed_streams()
    argv = sys.argv[1:]
    if argv[:1] == ["--bundle-check"]:
        return bundle_check(argv[1:])
    import importlib

    t0 = _process_start_t0()
    app_main = importlib.import_module(APP_MODULE)
    return app_main.main(argv, t0=t0)


if __name__ == "__main__":
    sys.exit(main())
