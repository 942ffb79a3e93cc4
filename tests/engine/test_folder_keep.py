"""A llama-family folder's bf16 weights multiplied from the files' mappings (``engine.model.folder_keep``): on a CPU
with ``--dtype bfloat16`` each linear is a BF16 ``BlockLinear`` viewing the mapped file (its bytes the file's, no
copy), the embedding a ``BlockEmbedding``, a tied head the embedding's blocks. The greedy tokens are HF ``generate``'s
on the bf16 model transformers loads from the same folder, and the folder path's (``KVSCOPE_MAP_FOLDERS=off``). A
header that lies (a tensor past the end, bytes that do not hold its shape, a dtype no one knows) gets one line."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, ModelSpec
from engine.errors import ModelFormatError
from engine.model import fit
from engine.model.loader import load_model
from engine.model import folder_keep
from engine.quant import kernel
from engine.quant.modules import BlockLinear

pytestmark = pytest.mark.skipif(kernel.library() is None, reason="no GGUF block kernels on this machine")
PROMPT = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376]


def _hf_agrees(folder: Path, model, got: list[int]) -> None:
    """HF ``generate``'s greedy tokens on the bf16 model transformers itself loads from the folder are ``got``, but
    where its bfloat16 logits tie (random weights: three ids at 0.566 in qwen3's tenth step): then each of ``got``
    is an argmax of HF's logits over the same tokens. The mapped model's logits are HF's within bfloat16's
    rounding."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    x = torch.tensor([PROMPT])
    seq = torch.tensor([PROMPT + got])
    with torch.inference_mode():
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=len(got), min_new_tokens=len(got),
                           do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
        logits = hf(seq).logits[0, len(PROMPT) - 1:-1].float()  # [len(got), vocab]
        ours = model(seq).logits[0, len(PROMPT) - 1:-1].float()
    assert torch.allclose(ours, logits, rtol=0, atol=2e-2 * logits.abs().max().item())
    chosen = logits.gather(1, torch.tensor(got)[:, None])[:, 0]
    assert got == want or torch.equal(chosen, logits.max(dim=1).values), (got, want)


def _mapped(files: list[Path]) -> list[str]:
    names = {str(f.resolve()) for f in files}
    with open("/proc/self/maps") as maps:
        return [line for line in maps if line.split()[-1] in names]


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("mistral", False), ("qwen3", False),
                                       ("granite", True), ("olmo2", False)])
def test_greedy_tokens_are_hf_generates_and_the_folder_paths(arch, tied, tmp_path, stories_path, monkeypatch):
    from test_exact import engine_greedy  # tests/engine is on sys.path
    from test_fit import _folder

    assert arch in folder_keep.MODEL_TYPES
    folder = _folder(tmp_path / arch, stories_path, arch, tie_word_embeddings=tied)
    spec = ModelSpec(source=str(folder), dtype="bfloat16", device="cpu")
    verdict = fit.estimate_path(folder, spec, "cpu")
    lm = load_model(spec)
    kinds = [type(m).__name__ for m in lm.model.modules()]
    assert kinds.count("BlockLinear") == 2 * 7 + 1 and kinds.count("BlockEmbedding") == 1  # the head too
    assert "Linear" not in kinds and "PackedLinear" not in kinds
    q = lm.model.model.layers[0].self_attn.q_proj
    assert q.ggml_type == 30 and q.out_map is None  # BF16 blocks in the file's (HF's) row order
    assert _mapped(list(folder.glob("*.safetensors")))  # the weights are the file's pages
    assert (lm.info.weights_format, lm.info.weights_held) == ("BF16", "mapped")
    assert lm.info.weights_bytes == verdict.weights.bytes and verdict.weights.held == "mapped"
    if tied:
        assert lm.model.lm_head.weight.data_ptr() == lm.model.model.embed_tokens.weight.data_ptr()
    from engine.quant.gguf_keep import skeleton  # what a compiled step's child builds: bf16 rows, as the parent's

    child = skeleton(type(lm.model), lm.model.config, torch.bfloat16, lm.model.kvscope_block_plan)
    assert child.model.embed_tokens.dtype == torch.bfloat16
    got = engine_greedy(lm, PROMPT, 16, CacheConfig())
    blocked = [m for m in lm.model.modules() if type(m).__name__ == "BlockLinear" and m.layout is not None]
    assert len(blocked) == 2 * 7 + 1 - tied  # bfloat16 compute: the native blocked product's layout, made then
    assert "blocked from the files' mappings" in lm.info.weights_kernel  # what the model card says of them
    assert all(m.packed is not None and m.packed.dim() == 3 for m in blocked)  # [out/16, in, 16]
    _hf_agrees(folder, lm.model, got)
    monkeypatch.setenv(folder_keep.ENV, "off")
    before = load_model(spec)
    assert "BlockLinear" not in {type(m).__name__ for m in before.model.modules()}
    assert engine_greedy(before, PROMPT, 16, CacheConfig()) == got


def test_other_loads_keep_the_folder_path(tmp_path, stories_path):
    """float32 (a CPU's default), float32 weights asked in bfloat16 (stories260K's: converted as read), a linear
    with a bias are read as before."""
    from test_fit import _folder

    folder = _folder(tmp_path / "llama", stories_path)
    assert "BlockLinear" not in {type(m).__name__ for m in load_model(str(folder)).model.modules()}
    stories = ModelSpec(source=str(stories_path), dtype="bfloat16", device="cpu")
    assert not folder_keep.applies(stories_path, "llama", stories, "bfloat16", "cpu")
    biased = _folder(tmp_path / "biased", stories_path, attention_bias=True)
    spec = ModelSpec(source=str(biased), dtype="bfloat16", device="cpu")
    assert not folder_keep.applies(biased, "llama", spec, "bfloat16", "cpu")
    assert "BlockLinear" not in {type(m).__name__ for m in load_model(spec).model.modules()}


def _write(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize("entry,words", [
    ({"dtype": "BF16", "shape": [4, 8], "data_offsets": [0, 64]}, "truncated"),  # past the end of the file
    ({"dtype": "BF16", "shape": [4, 8], "data_offsets": [0, 32]}, "holds 32 bytes but its shape"),
    ({"dtype": "Q9_Z", "shape": [4, 4], "data_offsets": [0, 32]}, "unknown dtype"),
    ({"dtype": "I8", "shape": [4, 8], "data_offsets": [0, 32]}, "is I8, not one of BF16, F16, F32"),
])
def test_a_header_that_lies_gets_one_line(tmp_path, entry, words):
    path = _write(tmp_path / "model.safetensors", {"w.weight": entry}, bytes(32))
    with pytest.raises((ValueError, ModelFormatError), match=words) as e:
        folder_keep.SafetensorsTable(path)
    assert "\n" not in str(e.value) and "model.safetensors" in str(e.value)


def test_a_folder_whose_header_lies_is_refused_in_one_line(tmp_path, stories_path):
    from test_fit import _folder

    folder = _folder(tmp_path / "llama", stories_path)
    path = folder / "model.safetensors"
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    with open(path, "r+b") as f:
        f.truncate(8 + n + 1000)  # the last tensors' bytes cut off
    with pytest.raises(ModelFormatError) as e:
        load_model(ModelSpec(source=str(folder), dtype="bfloat16", device="cpu"))
    assert "truncated" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("tied", [False, True])
def test_int8_blocks_quantized_from_the_mapping_are_the_folder_paths(tied, tmp_path, stories_path, monkeypatch):
    """``--quantize int8``: each linear's Q8_0 blocks quantized from the mapped file are the folder path's bit for
    bit (the output head and embedding in floats, as there; repacked at the first product, the rows read back),
    its greedy tokens HF ``generate``'s on the loaded model, the weights what the verdict said; no page of the file
    is held once loaded."""
    from test_exact import engine_greedy, hf_greedy
    from test_fit import _folder

    folder = _folder(tmp_path / "llama", stories_path, tie_word_embeddings=tied)
    spec = ModelSpec(source=str(folder), quantization="int8", device="cpu")
    verdict = fit.estimate_path(folder, spec, "cpu")
    lm = load_model(spec)
    assert [type(m).__name__ for m in lm.model.modules()].count("BlockLinear") == 2 * 7
    assert (lm.info.weights_format, lm.info.weights_bytes) == ("Q8_0", verdict.weights.bytes)
    assert not _mapped(list(folder.glob("*.safetensors")))
    got = engine_greedy(lm, PROMPT, 12, CacheConfig())
    assert got == hf_greedy(lm, PROMPT, 12)
    monkeypatch.setenv(folder_keep.ENV, "off")
    before = load_model(spec)
    a, b = lm.model.state_dict(), before.model.state_dict()
    blocks = {f"{n}.weight": m for n, m in lm.model.named_modules() if isinstance(m, BlockLinear)}
    assert all(m.rows_packed for m in blocks.values()) == kernel.packs(8)  # repacked, the rows let go
    assert a.keys() == b.keys() and all(torch.equal(blocks[k].rows() if k in blocks else a[k], b[k]) for k in a)
    assert engine_greedy(before, PROMPT, 12, CacheConfig()) == got


@pytest.mark.slow
def test_the_compiled_step_answers_the_blocked_linears_in_cpp(tmp_path, stories_path, monkeypatch):
    """A bf16 folder's compiled decode step (its package built in a child, ~20-40 s): once each linear's first call
    went through Python, the C++ operators answer every one from their table (through Python the 1B shape's 113
    calls took ~14 ms of a ~70 ms two-thread step), and the tokens are those of the same step with every call
    Python's."""
    from test_exact import engine_greedy
    from test_fit import _folder

    from engine.model import linear_op
    from engine.model.fast_step import FastStep, machine_refusal
    from engine.quant import gguf_op

    if machine_refusal(torch.device("cpu")):
        pytest.skip(f"cannot compile here: {machine_refusal(torch.device('cpu'))}")
    folder = _folder(tmp_path / "llama", stories_path, "llama")
    lm = load_model(ModelSpec(source=str(folder), dtype="bfloat16", device="cpu"))
    lm.runner.fast = FastStep(lm, mode="on")
    lm.fast.start()
    assert lm.fast.wait(600) and lm.fast.state == "on", lm.fast.describe()
    if not linear_op.loaded():
        pytest.skip(f"no C++ operators here: {linear_op.why()}")
    with monkeypatch.context() as m:
        m.setattr(gguf_op, "offer_blocked", lambda *a, **k: None)  # every product Python's
        gguf_op.forget()
        python = engine_greedy(lm, PROMPT, 12, CacheConfig(mode="paged", page_size=4))
        assert gguf_op.size() == 0
    assert lm.fast.calls.get("compiled", 0) >= 11
    gguf_op.forget()
    assert engine_greedy(lm, PROMPT, 12, CacheConfig(mode="paged", page_size=4)) == python
    assert gguf_op.size() == sum(isinstance(m, BlockLinear) for m in lm.model.modules())
