"""A loaded model as the engine holds it: ``LoadedModel`` (the torch module, its tokenizer and the facts the GUI
sees) and ``wrap_model``, which describes a model just loaded (``ModelInfo``, with what each layer caches from
``engine.model.arch.probe``) and sets up the CPU to run it. Finding and reading the files is
``engine.model.loader``'s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.config import ModelSpec
from engine.errors import UnsupportedModelError
from engine.model.weights_held import weights_bytes
from engine.snapshot import ModelInfo


@dataclass
class LoadedModel:
    """A model ready for sessions: the torch module, its tokenizer and the facts the GUI sees."""

    model: Any
    tokenizer: Any
    info: ModelInfo
    stop_ids: tuple[int, ...]
    path: str | None = None
    arenas: Any = None  # engine.kv.store.arena.ArenaRegistry, made on first use (``kv_arenas``)
    model_runner: Any = None  # engine.model.runner.ModelRunner, made on first use (``runner``)
    _device: Any = field(default=None, init=False, repr=False)  # ``device``, once read

    @property
    def device(self) -> torch.device:
        """Where the weights are (read once: walking the parameters is ~50 us, and a step asks several times)."""
        if self._device is None:
            self._device = next(self.model.parameters()).device
        return self._device

    @property
    def kv_shape(self):
        """What the model's attention layers cache (``engine.kv.quantized.roles.KVShape``), from its probe."""
        from engine.kv.quantized.roles import KVShape

        i = self.info
        return KVShape(i.num_layers, i.k_heads or i.num_kv_heads, i.k_dim or i.head_dim, self.kv_dtype, self.device,
                       i.v_heads, i.v_dim)

    @property
    def kv_arenas(self):
        """The page arenas this model's paged sessions share, with their common memory limit."""
        if self.arenas is None:
            from engine.kv.store.arena import ArenaRegistry

            self.arenas = ArenaRegistry(self.kv_shape, self.info.context_length)
        return self.arenas

    @property
    def runner(self):
        """The one place that calls this model (``engine.model.runner.ModelRunner``)."""
        if self.model_runner is None:
            from engine.model.runner import ModelRunner

            self.model_runner = ModelRunner(self)
        return self.model_runner

    @property
    def fast(self):
        """This model's compiled decode step (``engine.model.fast_step``): its state, setting and measurements."""
        return self.runner.fast

    @property
    def fast_step(self):
        """The compiled decode step if the runner exists yet (else None: nothing made just to be described)."""
        return self.model_runner.fast if self.model_runner is not None else None

    @property
    def kv_dtype(self) -> torch.dtype:
        return getattr(torch, self.info.kv_dtype)


def _stop_ids(model, tok) -> tuple[int, ...]:
    ids: list[int] = []
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None) if gc is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.append(eos)
    elif isinstance(eos, (list, tuple)):
        ids.extend(int(e) for e in eos if e is not None)
    if tok is not None and getattr(tok, "eos_token_id", None) is not None and tok.eos_token_id not in ids:
        ids.append(int(tok.eos_token_id))
    return tuple(dict.fromkeys(ids))


def _config_int(config, name: str) -> int:
    """A size from the configuration, 0 where it has none or only per-layer values (transformers raises for
    those: e.g. head counts that differ between layers)."""
    try:
        return int(getattr(config, name, 0) or 0)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError and kin
        return 0


def wrap_model(model, tok, spec: ModelSpec, device: str, reason: str, name: str, path: str | None,
               is_demo: bool, since=None) -> LoadedModel:
    """Describe a loaded torch model (``ModelInfo``, with what each layer caches from ``engine.model.arch.probe``) and
    bundle it with its tokenizer (None: ids only). ``since``: ``engine.model.threads.sample()`` at the load's start,
    the window the threads' choice measures other programs' work over."""
    from engine.model import prepack
    from engine.model.arch import attention_impl, info_fields, probe
    from engine.model.threads import cpu_features

    cfg = model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    q_heads = _config_int(text_cfg, "num_attention_heads")  # 0: none (Mamba, RWKV) or per layer: the probe says
    kv_dtype = _kv_dtype(model, spec)
    elem = torch.empty((), dtype=kv_dtype).element_size()
    impl = attention_impl(model)
    watch = prepack.Watch(model)  # which linears the probe feeds one tensor (q/k/v, gate/up): merged when packed
    try:
        facts, probe_refusal = probe(model)
    except Exception as e:  # noqa: BLE001 - a model that cannot even run three tokens
        raise UnsupportedModelError(f"{name}: the model failed on a three-token test run "
                                    f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
    weights_kernel = prepack.apply(model, watch.close(), device, spec.quantization)  # CPU: oneDNN-packed linears
    blocks = getattr(model, "kvscope_blocks", "")  # a GGUF's weights kept as blocks (engine.quant)
    weights_kernel = " · ".join(w for w in (blocks, weights_kernel) if w)
    stop = _stop_ids(model, tok)
    threads, threads_reason = _set_threads(model, device, since)
    info = ModelInfo(
        name=name,
        source=spec.source,
        architecture=(cfg.architectures or [type(model).__name__])[0],
        model_type=str(cfg.model_type),
        num_layers=len(facts) or _config_int(text_cfg, "num_hidden_layers"),
        num_q_heads=q_heads,
        hidden_size=_config_int(text_cfg, "hidden_size"),
        vocab_size=_config_int(text_cfg, "vocab_size"),
        context_length=int(getattr(text_cfg, "max_position_embeddings", 2048) or 2048),
        dtype=str(kv_dtype).replace("torch.", ""),
        kv_dtype=str(kv_dtype).replace("torch.", ""),
        device=device,
        device_reason=reason,
        quantization=spec.quantization,
        weights_bytes=weights_bytes(model),
        is_demo=is_demo,
        has_chat_template=bool(getattr(tok, "chat_template", None)) if tok is not None else False,
        stop_ids=stop,
        attn_impl=impl,
        threads=threads,
        threads_reason=threads_reason,
        cpu_features=cpu_features() if device == "cpu" else "",
        weights_kernel=weights_kernel,
        **info_fields(facts, elem, text_cfg, probe_refusal),
    )
    return LoadedModel(model=model, tokenizer=tok, info=info, stop_ids=stop, path=path)


def _kv_dtype(model, spec: ModelSpec) -> torch.dtype:
    """K/V come out of the projections in the activations' dtype (bitsandbytes computes in it too)."""
    kv_dtype = next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)
    if spec.quantization == "nf4":
        kv_dtype = getattr(model.config, "dtype", None) or kv_dtype
        if isinstance(kv_dtype, str):
            kv_dtype = getattr(torch, kv_dtype)
    return kv_dtype


def _set_threads(model, device: str, since=None) -> tuple[int, str]:
    """The threads this model runs on (``engine.model.threads``) set, with the CPU's memory and kernel set-up."""
    from engine.model.threads import apply as apply_threads
    from engine.model.threads import choose as choose_threads
    from engine.quant.modules import parameter_count

    threads, threads_reason = choose_threads(parameter_count(model), device, since)
    apply_threads(threads)
    if str(device) == "cpu":
        from engine.model import heap

        heap.keep_freed_memory()  # a prompt's activations reused, not faulted in again at every layer
    if threads > 1 and str(device) == "cpu":
        from engine.model import linear_op

        # several threads: the C++ kernels share a blocked linear's blocks, and quantized pages' attention heads
        linear_op.attach_soon()
    return threads, threads_reason
