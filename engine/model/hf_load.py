"""transformers' loading knobs shared by every kind of model file (``engine.model.loader``'s folders and hub ids,
``engine.model.gguf_load``'s GGUF files): the dtype, bitsandbytes' config, per-tensor progress and cancel, and quiet
logging."""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch

from engine.config import ModelSpec
from engine.errors import EngineError
from engine.model.log_once import once_per_message
from engine.model.notes import LoadNote, print_notes  # noqa: F401 (the loaders' notes, named from here too)

Progress = Callable[[str, float], None]  # (message, fraction 0..1 or -1 when unknown)


@contextlib.contextmanager
def weights_progress(name: str, progress: Progress | None, check: Callable[[], None]):
    """While transformers loads weights: report ``progress`` per tensor (fractions 0.15..0.95) and call
    ``check`` (which raises ``LoadCancelled``) before each one, through transformers' public tqdm hook."""
    from transformers.utils import logging as hf_logging

    def hook(factory, args, kwargs):
        if kwargs.get("desc") != "Loading weights" or not args or not hasattr(args[0], "__len__"):
            return factory(*args, **kwargs)  # any other progress bar: as transformers would make it
        items, total = args[0], max(len(args[0]), 1)
        every = max(1, total // 50)

        def tensors():
            for i, item in enumerate(items):
                check()
                if progress and i % every == 0:
                    progress(f"loading {name}: tensor {i + 1} of {total}", 0.15 + 0.8 * i / total)
                yield item

        return tensors()

    previous = hf_logging.set_tqdm_hook(hook)
    try:
        yield
    finally:
        hf_logging.set_tqdm_hook(previous)


def quiet_transformers() -> None:
    """No progress bars or advice on stderr: the CLI prints one line per problem, the app its own progress."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def choose_dtype(spec: ModelSpec, config, device: str) -> torch.dtype:
    """The compute dtype (``weights_plan.compute_dtype_name``: the memory estimate asks it without torch)."""
    from engine.model.weights_plan import compute_dtype_name

    cfg_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return getattr(torch, compute_dtype_name(spec.dtype, str(cfg_dtype).replace("torch.", "") if cfg_dtype else "",
                                             device))


def bnb_config(kind: str, compute_dtype: torch.dtype):
    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)  # its CPU backend warns at import about an optional kernel: not one line
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError:
        raise EngineError("8-bit/4-bit needs the bitsandbytes package (pip install bitsandbytes)") from None
    finally:
        log.setLevel(level)
    if kind == "int8":
        once_per_message("bitsandbytes.autograd._functions")  # its float16-cast warning: each matmul (175 lines)
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype)


def fix_bnb_4bit_cpu(model) -> None:
    """The 4-bit linears on a CPU: multiplied by the block kernels (``nf4_quant.to_blocks``: the same NF4 codes; a
    1B-shape token's linears 29 ms against bitsandbytes' CPU kernel's 53, one thread) unless
    ``KVSCOPE_NF4=bitsandbytes``. Those left to bitsandbytes: its AVX512-BF16
    kernel rejects layers whose out_features % 32 or in_features % 64 is not 0 (stories260K's 172-wide MLP), which
    use its generic path instead; the others get its layout now (``nf4_quant.cpu_layout``)."""
    import sys

    if "bitsandbytes" not in sys.modules:
        return  # nothing of it loaded: no 4-bit module to fix (a folder's mapped NF4 load), its import spared
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return
    from engine.model import nf4_quant

    if nf4_quant.available("cpu"):
        nf4_quant.to_blocks(model)
    for mod in model.modules():
        if isinstance(mod, Linear4bit) and (mod.out_features % 32 or mod.in_features % 64):
            mod.support_avx512bf16_for_cpu = False
    nf4_quant.cpu_layout(model)  # the kernel's layout made now, in C (bitsandbytes' torch code at first forward)
