"""Linear weights held for the CPU kernels that read them fastest (``engine.model.prepack``: oneDNN-packed or
blocked) and bf16 decode attention in float32 (``engine.kv.store.attention.sdpa``): HF's greedy tokens of the
unpacked model, one copy of the weights, the kernels actually taken on the eager, batched and compiled paths; the
layout each workload gets; what auto leaves alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.config import CacheConfig, ModelSpec, SamplingConfig
from engine.core.session import ChatSession
from engine.model import prepack
from engine.model.loader import load_model
from engine.model.packed_linear import MergedPart, PackedLinear

N = 300
OPS = ("mkldnn::_linear_pointwise", "aten::bmm")  # oneDNN-packed, blocked


@pytest.fixture(scope="module")
def packed(stories_path):
    """stories260K with every linear packed (``on``: its 64-wide ones are below what auto packs), as a chat's
    float32 model: blocked where the width allows (q/k/v 128, o 64, down 64), oneDNN for gate/up (2 x 172)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("KVSCOPE_PREPACK", "on")
    try:
        return load_model(ModelSpec(source=str(stories_path)))
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def prompt(stories):
    return stories.tokenizer("Once upon a time")["input_ids"]


def hf_greedy(lm, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = lm.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def greedy(lm, ids: list[int], n: int, cache: CacheConfig) -> list[int]:
    s = ChatSession(lm, cache)
    s.start_ids(ids, SamplingConfig(max_new_tokens=n, ignore_eos=True))
    while not s.step().done:
        pass
    s.close()
    return s.generated_ids


def kernel_calls(fn) -> dict[str, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages() if e.key in OPS}


def test_the_reference_is_not_packed_and_the_packed_model_says_so(stories, packed):
    assert stories.info.weights_kernel == ""  # auto: stories260K's linears are all under MIN_ELEMENTS
    assert packed.info.weights_kernel == "10 oneDNN-packed · 25 blocked · 10 merged (q/k/v, gate/up)"
    attn, mlp = packed.model.model.layers[0].self_attn, packed.model.model.layers[0].mlp
    assert isinstance(attn.q_proj, PackedLinear) and attn.q_proj.splits == (64, 32, 32)
    assert isinstance(attn.k_proj, MergedPart) and isinstance(mlp.up_proj, MergedPart)
    assert attn.q_proj.kind == "blocked" and attn.q_proj.weight.shape == (128 // 16, 64, 16)
    assert mlp.gate_proj.kind == "onednn" and mlp.gate_proj.weight.is_mkldnn  # 344 is no multiple of 16


def test_packed_greedy_is_hf_greedy_of_the_unpacked_model(stories, packed, prompt):
    ref = hf_greedy(stories, prompt, N)  # transformers' own kernels on the plain weights
    assert greedy(packed, prompt, N, CacheConfig(mode="paged", page_size=16)) == ref
    assert greedy(packed, prompt, 40, CacheConfig(mode="contiguous")) == ref[:40]
    ids = torch.tensor([prompt + ref])
    with torch.inference_mode():
        a, b = stories.model(input_ids=ids).logits, packed.model(input_ids=ids).logits  # [1, n, vocab]
    assert (a - b).abs().max().item() < 1e-4  # measured 1.7e-5 (logits up to 23)


def test_batched_decoding_on_packed_weights_is_exact(stories, packed, prompt):
    from engine.core import scheduler as batch

    ref = hf_greedy(stories, prompt, 60)
    other = prompt[:2] + [42, 7]
    ref2 = hf_greedy(stories, other, 60)
    sessions = [ChatSession(packed, CacheConfig(mode="paged", page_size=16)) for _ in range(2)]
    for s, ids in zip(sessions, (prompt, other)):
        s.start_ids(ids, SamplingConfig(max_new_tokens=60, ignore_eos=True))
    before = packed.runner.batched_forwards
    while live := [s for s in sessions if s.generating]:
        batch.step_all(live)
    assert packed.runner.batched_forwards > before + 40
    assert [s.generated_ids for s in sessions] == [ref, ref2]
    for s in sessions:
        s.close()


def test_every_layer_runs_its_projections_through_the_packed_kernel(packed, prompt, monkeypatch):
    from engine.model import linear_kernel

    native = []
    real = linear_kernel.product
    monkeypatch.setattr(linear_kernel, "product", lambda *a: native.append(a[0].shape[0]) or real(*a))
    s = ChatSession(packed, CacheConfig(mode="paged", page_size=16))
    s.start_ids(prompt, SamplingConfig(max_new_tokens=3, ignore_eos=True))
    s.step()  # prefill (its 5 rows go through the native product too)
    native.clear()
    calls = kernel_calls(s.step)  # one decode step, eager
    s.close()
    # 5 layers: q/k/v merged, o and down blocked; gate/up merged, oneDNN (the tied lm_head stays the embedding's).
    # The blocked ones run the native product where it is built (torch's profiler does not see it), else bmm.
    if linear_kernel.LINEAR.library() is not None and torch.get_num_threads() == 1:
        assert calls == {"mkldnn::_linear_pointwise": 5} and native == [1] * (5 * 3)
    else:
        assert calls == {"aten::bmm": 5 * 3, "mkldnn::_linear_pointwise": 5}


def test_one_copy_of_the_weights(stories, packed):
    ptrs = [torch.ops.mkldnn.data_ptr(p) if p.is_mkldnn else p.data_ptr() for p in packed.model.parameters()]
    assert len(ptrs) == len(set(ptrs))
    assert packed.info.weights_bytes == stories.info.weights_bytes
    assert [n for n, m in packed.model.named_modules() if type(m) is nn.Linear] == ["lm_head"]  # tied: a view
    assert not list(packed.model.model.layers[0].self_attn.k_proj.parameters())  # the owner holds the group's


def test_the_kv_disk_fingerprint_reads_packed_weights(stories, packed):
    from engine.kv.tier.fingerprint import model_fingerprint

    assert model_fingerprint(packed) != model_fingerprint(stories)  # other kernels: other last bits, other pages
    assert model_fingerprint(packed) == model_fingerprint(packed)


class Twins(nn.Module):
    """Two blocks: one whose siblings share their input, one whose k sees another tensor (cross-attention)."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.a = nn.ModuleDict({n: nn.Linear(width, width, bias=n == "v") for n in ("q", "k", "v")})
        self.b = nn.ModuleDict({n: nn.Linear(width, width) for n in ("q", "k")})

    def forward(self, x):
        y = self.a["q"](x) + self.a["k"](x) * 2
        z = self.a["v"](x)
        return self.b["q"](y) - self.b["k"](z)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_siblings_merge_only_where_they_share_their_input(dtype):
    torch.manual_seed(0)
    m = Twins().to(dtype).eval()
    x = torch.randn(3, 256, dtype=dtype)
    watch = prepack.Watch(m)
    with torch.inference_mode():
        want = m(x)
    plan = prepack.plan(m, watch.close(), "auto")
    assert set(plan.groups) == {("a.q", "a.k"), ("a.v",), ("b.q",), ("b.k",)}  # bias differs: v alone
    prepack.restructure(m, plan)
    with torch.inference_mode():
        got = m(x)
        assert torch.equal(m(x), got)  # the held output is let go once both members took theirs
        k_alone = m.a["k"](x)  # a member asking on its own computes afresh
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - want.float()).abs().max().item() < tol
    assert k_alone.shape == (3, 256)


def fed(model, *shape) -> dict:
    watch = prepack.Watch(model)
    with torch.inference_mode():
        model(torch.randn(*shape))
    return watch.close()


def test_auto_leaves_small_quantized_uncalled_and_switched_off_linears_alone(monkeypatch):
    small = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    assert prepack.plan(small, fed(small, 2, 64), "auto").groups == ()
    assert prepack.plan(small, fed(small, 2, 64), "on").groups == (("0",), ("1",))
    big = nn.Sequential(nn.Linear(256, 256))
    seen = fed(big, 2, 256)
    assert prepack.plan(big, {}, "auto").groups == ()  # never called in the probe: the model may read its weight
    assert prepack.apply(big, seen, "cpu", "int8") == "" and type(big[0]) is nn.Linear  # bitsandbytes models
    assert prepack.apply(big, seen, "cuda", "none") == "" and type(big[0]) is nn.Linear
    assert prepack.apply(big, seen, "cpu", "none", mode="off") == "plain (KVSCOPE_PREPACK=off)"
    assert type(big[0]) is nn.Linear
    assert prepack.apply(big, seen, "cpu", "none") == "1 blocked"
    assert isinstance(big[0], PackedLinear) and prepack.plan_of(big).groups == (("0",),)
    monkeypatch.setenv("KVSCOPE_PREPACK", "sometimes")
    assert prepack.env_mode() == "auto"


def test_each_workload_gets_the_layout_its_rows_read_fastest(monkeypatch):
    monkeypatch.delenv("KVSCOPE_PREPACK_KIND", raising=False)
    assert prepack.kind_for(torch.float32, 960) == "blocked"  # a chat's one-row steps
    assert prepack.kind_for(torch.float32, 344) == "onednn"  # no multiple of 16
    from engine.model import linear_kernel

    from engine.model.packed_linear import onednn_takes

    native = linear_kernel.LINEAR.library() is not None  # bfloat16 blocked only with the native product
    bf16 = "onednn" if onednn_takes(torch.bfloat16) else "blocked"  # AVX2 only: oneDNN has no bfloat16 product
    assert prepack.kind_for(torch.bfloat16, 960) == ("blocked" if native else bf16)
    monkeypatch.setenv("KVSCOPE_NATIVE", "off")
    assert prepack.kind_for(torch.bfloat16, 960) == bf16
    monkeypatch.delenv("KVSCOPE_NATIVE")
    monkeypatch.setattr(prepack, "_workload", "chat")
    prepack.set_workload("server")  # engine serve: batches
    assert prepack.kind_for(torch.float32, 960) == "onednn"
    monkeypatch.setenv("KVSCOPE_PREPACK_KIND", "blocked")
    assert prepack.kind_for(torch.float32, 960) == "blocked" and prepack.kind_for(torch.bfloat16, 960) == "blocked"
    with pytest.raises(ValueError, match="workload 'gpu' is not one of chat, server"):
        prepack.set_workload("gpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_products_at_every_row_count_match_plain_ones(dtype):
    """At every row count, on every CPU: bfloat16 prompts too where oneDNN has no bfloat16 product (AVX2 only:
    it refused every prompt of more than 64 tokens there)."""
    from engine.model.packed_linear import BLOCKED_MAX_ROWS, block, unblock

    torch.manual_seed(0)
    w, b = torch.randn(96, 80).to(dtype), torch.randn(96).to(dtype)
    wb = block(w)
    assert torch.equal(unblock(wb), w)
    lin = PackedLinear(wb, b, (96,), "blocked", 80)
    for rows in (1, 3, 17, BLOCKED_MAX_ROWS, BLOCKED_MAX_ROWS + 1, 200):  # native, bmm or oneDNN by rows and CPU
        x = torch.randn(2, rows, 80).to(dtype)
        want = torch.nn.functional.linear(x.float(), w.float(), b.float())
        # bfloat16: the output rounded to 8 bits of mantissa (0.4 %), torch's partial sums rounded too
        tol = 1e-4 if dtype == torch.float32 else 1e-2 * want.abs().max().item()
        assert (lin(x).float() - want).abs().max().item() < tol


def test_without_a_onednn_bfloat16_product_bfloat16_weights_are_blocked_or_left_alone(monkeypatch):
    """An AVX2-only CPU (oneDNN's bfloat16 product needs AVX-512): bfloat16 linears are never oneDNN's, in a chat
    or a server; one whose rows are no multiple of 16 stays as loaded, and a 100-token prompt runs through."""
    from engine.model import packed_linear

    monkeypatch.delenv("KVSCOPE_PREPACK_KIND", raising=False)
    monkeypatch.setattr(packed_linear, "onednn_takes", lambda dtype: dtype == torch.float32)
    monkeypatch.setattr(prepack, "_workload", "chat")
    for workload in ("chat", "server"):
        prepack.set_workload(workload)
        assert prepack.kind_for(torch.bfloat16, 960) == "blocked" and prepack.kind_for(torch.bfloat16, 344) == ""
    assert prepack.kind_for(torch.float32, 344) == "onednn"
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 344)).to(torch.bfloat16)
    x = torch.randn(100, 256, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = m(x).float()
    watch = prepack.Watch(m)
    with torch.inference_mode():
        m(x[:2])
    assert prepack.apply(m, watch.close(), "cpu", "none") == "1 blocked"
    assert isinstance(m[0], PackedLinear) and type(m[1]) is nn.Linear
    with torch.inference_mode():
        assert (m(x).float() - want).abs().max().item() < 2e-2 * want.abs().max().item()


def test_bf16_attention_of_few_queries_runs_in_float32():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from engine.kv.store.attention import UPCAST_MAX_Q, sdpa

    mod = nn.Module()
    mod.is_causal, mod.num_key_value_groups = True, 3
    torch.manual_seed(0)
    k, v = torch.randn(1, 3, 512, 64, dtype=torch.bfloat16), torch.randn(1, 3, 512, 64, dtype=torch.bfloat16)
    q = torch.randn(1, 9, 1, 64, dtype=torch.bfloat16)
    out, _ = sdpa(mod, q, k, v, None)
    f32, _ = sdpa_attention_forward(mod, q.float(), k.float(), v.float(), None)
    assert out.dtype == torch.bfloat16 and torch.equal(out, f32.to(torch.bfloat16))
    long_q = torch.randn(1, 9, UPCAST_MAX_Q + 1, 64, dtype=torch.bfloat16)
    mask = torch.ones(UPCAST_MAX_Q + 1, 512, dtype=torch.bool).tril(512 - UPCAST_MAX_Q - 1)[None, None]
    got, _ = sdpa(mod, long_q, k, v, mask)
    plain, _ = sdpa_attention_forward(mod, long_q, k, v, mask)
    assert torch.equal(got, plain)  # a prompt keeps the bf16 kernel


@pytest.mark.slow
def test_the_compiled_step_runs_on_the_packed_and_blocked_weights_and_stays_exact(stories, packed, prompt):
    """The child builds the same merged modules with plain weights; the package's graph calls oneDNN, and the
    parent hands it the packed weights (no copy): HF's greedy ids, every decode step compiled."""
    from engine.model.fast_step import FastStep, machine_refusal

    if machine_refusal(torch.device("cpu")):
        pytest.skip(machine_refusal(torch.device("cpu")))
    packed.runner.fast = FastStep(packed, mode="on")
    packed.fast.start()
    assert packed.fast.wait(1800) and packed.fast.state == "on", packed.fast.describe()
    s = ChatSession(packed, CacheConfig(mode="paged", page_size=16))
    s.start_ids(prompt, SamplingConfig(max_new_tokens=100, ignore_eos=True))
    paths = []
    while not (r := s.step()).done:
        paths.append(r.event.path)
    assert paths[1:] == ["compiled"] * (len(paths) - 1)
    assert s.generated_ids == hf_greedy(stories, prompt, 100)
    s.close()
    calls = package_calls(packed.fast.package)  # the package's own calls, on our weights
    assert calls["onednn"] == 5 and calls["mm"] == 1  # gate/up; MKL only for the tied lm_head
    from engine.model import linear_kernel

    if linear_kernel.in_graph():  # each blocked product calls the native one (kvscope::blocked_linear), and each
        # layer's attention reads its pages in place (kvscope::paged_decode): no flash attention over gathered K/V
        assert calls["native"] == 5 * 3 + 5 and calls["blocked"] == 0 and calls["flash"] == 0
    else:
        assert calls["blocked"] >= 5  # inductor fused each layer's blocked products into its own C++ loops


def package_calls(path) -> dict[str, int]:
    """What a compiled step's C++ calls (the profiler does not see inside the package): oneDNN linears, MKL
    matmuls, fused loops that hold a blocked product (inductor writes one-row bmm as its own loop), operators
    called through torch's dispatcher (the native blocked product, the paged decode attention) and torch's flash
    attention."""
    import re
    import zipfile

    with zipfile.ZipFile(path) as z:
        code = "".join(z.read(n).decode(errors="replace") for n in z.namelist() if n.endswith("wrapper.cpp"))
    return {"onednn": len(re.findall(r"aoti_torch_cpu__linear_pointwise(?:_binary)?\(", code)),
            "mm": len(re.findall(r"aoti_torch_cpu_(?:addmm|mm)_out\(", code)),
            "blocked": len(re.findall(r"cpp_fused_\w*bmm\w*\(", code)) + len(re.findall(r"aoti_torch_cpu_bmm_out\(", code)),
            "native": len(re.findall(r"aoti_torch_proxy_executor_call_function\(", code)),
            "flash": len(re.findall(r"aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu\(", code))}
