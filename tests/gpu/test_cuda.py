"""On a CUDA GPU: exact tokens in float32, top-1 agreement with HF in bf16 and nf4, memory readout against the
estimate, pinned swap bit for bit. Run by ``tests/gpu/run.sh`` (skipped without CUDA)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from engine.config import CacheConfig, ModelSpec, SamplingConfig
from engine.model.loader import load_model
from engine.core.session import ChatSession
from engine.model.shapes import build_shape

# A dry run of these checks on the CPU: KVSCOPE_GPU_TEST_DEVICE=cpu KVSCOPE_GPU_TEST_SHAPE=tiny-qwen2
DEVICE = os.environ.get("KVSCOPE_GPU_TEST_DEVICE", "cuda")
SHAPE = os.environ.get("KVSCOPE_GPU_TEST_SHAPE", "qwen2.5-0.5b")
# No conftest.py here: a second ``conftest`` module would shadow tests/app's ``from conftest import ...``
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                                  reason="no CUDA device (torch.cuda.is_available() is False)")]
N_STORIES = 300
N_AGREE = 256  # tokens compared for top-1 agreement (the figure)
AGREE_MIN = 0.999  # top-1 agreement, ties within the numeric noise not counted (see ``agreement``)
NOISE_MAX = 0.05  # largest logit difference from HF, relative to the largest logit (bf16 through 24 layers)


@pytest.fixture(scope="module")
def record():
    """``record(name, **figures)``: keep a measured figure for the report (JSON lines in
    ``$KVSCOPE_GPU_FIGURES``, and printed)."""
    path = os.environ.get("KVSCOPE_GPU_FIGURES")

    def write(name: str, **figures) -> None:
        line = json.dumps({"check": name, **figures})
        print(line)
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(line + "\n")

    return write


def hf_generate(lm, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy ids and its logits for each of them ([n, vocab], float32 on the GPU)."""
    x = torch.tensor([ids], device=lm.device)
    with torch.inference_mode():
        out = lm.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                                return_dict_in_generate=True)
    logits = torch.stack([s[0] for s in out.logits]).float()  # [n, vocab]
    return out.sequences[0, len(ids):].tolist(), logits


def engine_greedy(lm, ids: list[int], n: int, cache: CacheConfig) -> list[int]:
    s = ChatSession(lm, cache)
    try:
        s.start_ids(ids, SamplingConfig(max_new_tokens=n, ignore_eos=True))
        while not (r := s.step()).done:
            pass
        assert r.stop_reason == "max_tokens"
        return s.generated_ids
    finally:
        s.close()


def agreement(lm, prompt: list[int], cache: CacheConfig) -> dict:
    """Teacher-force HF's greedy continuation through our cache; compare top-1 at each of its tokens."""
    ref, hf_logits = hf_generate(lm, prompt, N_AGREE)
    s = ChatSession(lm, cache)
    with torch.inference_mode():
        ours = [x.float().reshape(-1) for x in s.teacher_force(prompt + ref[:-1], prefill=len(prompt))]
    s.close()
    ours_t = torch.stack(ours)  # [n, vocab]
    top = ours_t.argmax(-1).tolist()
    same = sum(int(a == b) for a, b in zip(top, ref))
    gap = hf_logits.topk(2, dim=-1).values  # [n, 2]: HF's margin where we disagree tells a near-tie apart
    misses = [i for i, (a, b) in enumerate(zip(top, ref)) if a != b]
    noise = float((ours_t - hf_logits).abs().max())
    margins = [float(gap[i, 0] - gap[i, 1]) for i in misses]
    # A miss where HF's own top two are closer than twice the largest logit difference is a tie that
    # rounding decides (random weights have many: margins of 2e-4 on a 2.4 logit scale), not a wrong pick.
    real = [i for i, m in zip(misses, margins) if m > 2 * noise]
    return {"tokens": len(ref), "agree_raw": same / len(ref), "agree": 1 - len(real) / len(ref), "misses": misses,
            "hf_margin_at_misses": [round(m, 5) for m in margins], "max_abs_logit_diff": noise,
            "logit_scale": float(hf_logits.abs().max())}


def _prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def qwen_bf16():
    lm = build_shape(SHAPE, device=DEVICE, dtype=torch.bfloat16)
    yield lm
    del lm
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def stories_gpu(stories_path):
    return load_model(ModelSpec(source=str(stories_path), device=DEVICE, dtype="float32"))


def test_stories_exact_on_cuda(stories_gpu, record):
    """float32 on the GPU: every lossless mode gives HF's greedy ids for 300 tokens."""
    lm = stories_gpu
    assert lm.device.type == DEVICE and lm.info.device_reason.startswith(DEVICE.upper())
    ids = lm.tokenizer("Once upon a time")["input_ids"]
    ref, _ = hf_generate(lm, ids, N_STORIES)
    assert lm.tokenizer.decode(ref[:40]).startswith(", there was a little girl named Lily.")
    for cache in (CacheConfig(mode="off"), CacheConfig(mode="contiguous"), CacheConfig(mode="paged", page_size=3),
                  CacheConfig(mode="paged", page_size=16)):
        got = engine_greedy(lm, ids, N_STORIES, cache)
        first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        record("stories-exact-cuda", mode=f"{cache.mode}/{cache.page_size}", first_divergence=first)
        assert got == ref, f"{cache.mode}: first divergence at token {first}"


def test_batched_decoding_exact_on_cuda(stories_gpu, record):
    """Four chats decoded in one forward per step on the GPU (float32): each gets HF's greedy ids."""
    from engine.core import scheduler as batch
    from engine.core.session import ChatSession

    lm = stories_gpu
    prompts = ["Once upon a time", "The cat sat on", "Lily and Tom went to the park. They", "A big red ball"]
    n = 120
    sessions = [ChatSession(lm, c) for c in (CacheConfig(mode="paged", page_size=16), CacheConfig(mode="paged", page_size=3),
                                              CacheConfig(mode="contiguous"), CacheConfig(mode="paged", page_size=16))]
    for s, p in zip(sessions, prompts):
        s.start_ids(lm.tokenizer(p)["input_ids"], SamplingConfig(max_new_tokens=n, ignore_eos=True))
    together = 0
    while live := [s for s in sessions if s.generating]:
        together = max(together, sum(map(len, batch.batchable(live))))
        for r in batch.step_all(live):
            assert not isinstance(r, BaseException), r
    firsts = []
    for s, p in zip(sessions, prompts):
        ref, _ = hf_generate(lm, lm.tokenizer(p)["input_ids"], n)
        firsts.append(next((i for i, (a, b) in enumerate(zip(s.generated_ids, ref)) if a != b), None))
    record("batched-exact-cuda", sessions=4, decoded_together=together, first_divergence=firsts)
    assert together == 4 and firsts == [None] * 4


def test_bf16_paged_top1_agreement(qwen_bf16, record):
    """Qwen2.5-0.5B shape in bf16: our paged decode picks HF's top-1 at ≥ 99.9% of 256 tokens."""
    prompt = _prompt(qwen_bf16.info.vocab_size, 64)
    for cache in (CacheConfig(mode="paged", page_size=16), CacheConfig(mode="contiguous")):
        a = agreement(qwen_bf16, prompt, cache)
        record("top1-bf16", mode=cache.mode, **a)
        assert a["agree"] >= AGREE_MIN and a["max_abs_logit_diff"] <= NOISE_MAX * a["logit_scale"], a


def test_nf4_paged_top1_agreement_and_estimate(qwen_bf16, stories_path, tmp_path, record):
    """The same shape saved and loaded through the real loader with bitsandbytes NF4 on the GPU."""
    folder = tmp_path / "qwen-shape"
    qwen_bf16.model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(stories_path / name, folder / name)
    cuda = DEVICE == "cuda"
    before = torch.cuda.memory_allocated() if cuda else 0
    lm = load_model(ModelSpec(source=str(folder), quantization="nf4", device=DEVICE))
    weights = torch.cuda.memory_allocated() - before if cuda else lm.info.weights_bytes
    assert "Linear4bit" in {type(m).__name__ for m in lm.model.modules()}
    prompt = _prompt(lm.info.vocab_size, 64)
    a = agreement(lm, prompt, CacheConfig(mode="paged", page_size=16))
    from app.models.estimate import verdict

    est = verdict(folder, "nf4", DEVICE, (1 << 40, "the test's budget")).weights.bytes
    record("top1-nf4", weights_bytes=weights, estimated_weights_bytes=est, **a)
    assert a["agree"] >= AGREE_MIN and a["max_abs_logit_diff"] <= NOISE_MAX * a["logit_scale"], a
    assert abs(est - weights) <= 0.15 * weights, (est, weights)
    del lm
    if cuda:
        torch.cuda.empty_cache()


def test_memory_readout_and_fit(qwen_bf16, record):
    """The memory panel's device figure is CUDA's own; weights + KV at 4k agree with the models dialog's
    estimate, and the KV arena's limit follows the GPU's free memory."""
    from engine.kv.store.arena import GPU_SHARE, default_memory_limit
    from engine.model import fit

    if DEVICE != "cuda":
        pytest.skip("CUDA memory figures")
    s = ChatSession(qwen_bf16, CacheConfig(mode="paged", page_size=16))
    s.start_ids(_prompt(qwen_bf16.info.vocab_size, 4080), SamplingConfig(max_new_tokens=16, ignore_eos=True))
    while not (r := s.step()).done:
        pass
    snap = r.snapshot
    torch.cuda.synchronize()
    assert 0 < snap.device_bytes <= torch.cuda.max_memory_allocated()
    assert snap.weights_bytes + snap.kv_bytes <= snap.device_bytes
    config = qwen_bf16.model.config.to_dict()
    kv = fit.attention_of(config).cache_bytes("auto", 2, 4096)  # the engine's verdict: bfloat16 K/V at 4k
    free, total = torch.cuda.mem_get_info()
    limit = default_memory_limit(torch.device("cuda"))
    record("memory-4k-bf16", weights_bytes=snap.weights_bytes, kv_bytes=snap.kv_bytes,
           estimated_kv_bytes=kv, device_bytes=snap.device_bytes, total_bytes=total,
           kv_limit_bytes=limit, fits=snap.weights_bytes + kv <= total)
    s.close()
    assert abs(kv - snap.kv_bytes) <= 0.05 * snap.kv_bytes  # pages round up by < one page per layer
    assert snap.weights_bytes + kv <= total
    assert abs(limit - GPU_SHARE * free) <= 0.01 * total


def test_swap_pinned_bit_for_bit(qwen_bf16, record):
    """Swap a bf16 chat's pages to pinned host memory and back: the same K/V bits, pages given back and
    taken again. (Its next tokens are compared in float32 below: in bf16, where the pages land decides which
    attention kernel runs, and random weights have near-ties that such differences flip.)"""
    prompt = _prompt(qwen_bf16.info.vocab_size, 300, seed=5)
    s = ChatSession(qwen_bf16, CacheConfig(mode="paged", page_size=16))
    s.start_ids(prompt, SamplingConfig(max_new_tokens=16, ignore_eos=True))
    while not s.step().done:
        pass
    before = s.store.to_host()
    moved = s.swap_out()
    host_tensors = [t for layer in s.host.layers for t in _tensors(layer)]
    assert moved > 0 and host_tensors and all(t.is_pinned() == (DEVICE == "cuda") for t in host_tensors)
    assert s.snapshot().kv_bytes == 0
    s.swap_in()
    after = s.store.to_host()
    same = all(torch.equal(a, b) for a, b in zip(_all(before), _all(after)))
    record("swap-pinned", bytes=moved, bit_for_bit=same)
    assert same and len(_all(before)) == len(_all(after))
    s.close()


def test_swap_continues_exactly(stories_gpu, record):
    """float32: a chat swapped out and back between turns goes on with the tokens of one never swapped."""
    prompt = stories_gpu.tokenizer("Once upon a time")["input_ids"]
    runs = []
    for swap in (False, True):
        s = ChatSession(stories_gpu, CacheConfig(mode="paged", page_size=16))
        for n in (40, 60):
            if swap and s.seq:
                s.swap_out()
                s.swap_in()
            s.start_ids(list(s.seq) or prompt, SamplingConfig(max_new_tokens=n, ignore_eos=True))
            while not s.step().done:
                pass
        runs.append(s.seq[len(prompt):])
        s.close()
    record("swap-float32", tokens_equal=runs[0] == runs[1])
    assert runs[0] == runs[1] and len(runs[0]) == 100


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
    elif hasattr(x, "__dict__"):
        for v in vars(x).values():
            yield from _tensors(v)


def _all(host) -> list[torch.Tensor]:
    return [t for layer in host.layers for t in _tensors(layer)]


@pytest.mark.parametrize("cache", [
    CacheConfig(mode="paged", k_dtype="int8", v_dtype="int8"),
    CacheConfig(mode="paged", k_dtype="int4", v_dtype="int4"),
    CacheConfig(mode="paged", policy="streaming", policy_params={"sinks": 4, "window": 120}),
    CacheConfig(mode="paged", policy="h2o", policy_params={"budget": 128, "recent": 32}),
    CacheConfig(mode="paged", policy="priority", policy_params={"budget": 128}),
], ids=lambda c: f"{c.k_dtype}-{c.policy}")
def test_lossy_settings_run_on_cuda(qwen_bf16, cache, record):
    """Every precision and policy runs on GPU tensors (host index arrays, device pages) and keeps its budget."""
    s = ChatSession(qwen_bf16, cache.replace(overflow="policy") if cache.policy != "none" else cache)
    s.start_ids(_prompt(qwen_bf16.info.vocab_size, 300, seed=7), SamplingConfig(max_new_tokens=64, ignore_eos=True))
    while not (r := s.step()).done:
        pass
    held = int(r.snapshot.tokens_per_layer.max())
    record("lossy-cuda", k=cache.k_dtype, policy=cache.policy, held=held, evicted=s.evicted_total,
           kv_bytes=r.snapshot.kv_bytes)
    assert r.stop_reason == "max_tokens" and len(s.generated_ids) == 64
    if cache.policy != "none":
        assert held <= 128 and s.evicted_total >= 300 + 63 - 128
    s.close()


def test_switches_mid_reply_on_cuda(stories_gpu, record):
    """Mode and page size changed mid-reply on the GPU (float32): the reply goes on with HF's exact tokens."""
    prompt = stories_gpu.tokenizer("Once upon a time")["input_ids"]
    ref, _ = hf_generate(stories_gpu, prompt, 40)
    s = ChatSession(stories_gpu, CacheConfig(mode="paged", page_size=16))
    s.start_ids(prompt, SamplingConfig(max_new_tokens=40, ignore_eos=True))
    plan = {5: CacheConfig(mode="contiguous"), 12: CacheConfig(mode="paged", page_size=3),
            20: CacheConfig(mode="off"), 28: CacheConfig(mode="paged", page_size=64)}
    i = 0
    while not s.step().done:
        i += 1
        if i in plan:
            s.apply(plan[i])
    got = s.generated_ids
    first = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), None)
    record("switches-cuda", first_divergence=first)
    assert got == ref
    s.close()


def test_sliding_window_model_on_cuda(record):
    """Gemma 3's shape (5 sliding : 1 full) on the GPU: paged picks HF's top-1 and the sliding layers hold only
    their window."""
    lm = build_shape("gemma3-1b", device=DEVICE, dtype=torch.bfloat16)
    prompt = _prompt(lm.info.vocab_size, 700, seed=11)
    a = agreement(lm, prompt, CacheConfig(mode="paged", page_size=16))
    record("top1-gemma3-bf16", **a)
    assert a["agree"] >= AGREE_MIN and a["max_abs_logit_diff"] <= NOISE_MAX * a["logit_scale"], a
    del lm
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
