"""GGUF files made by llama.cpp's own converter (``convert_hf_to_gguf.py`` from the llama-cpp-python sdist on PyPI)
through the engine (#32): the cross-check of ``gguf_make``'s in-process writer against the files people have.

    python tests/engine/measure_llamacpp_gguf.py [--cache DIR]

The sdist is fetched once with ``pip download --no-deps --no-binary :all: llama-cpp-python`` into the cache
(``~/.cache/kvscope/llama-cpp-python``; only its converter and its vendored gguf-py are unpacked) and reused; offline
without it, the script says so and exits 0. Converts stories260K and random-weight llama, qwen2 and gemma2 folders
(stories260K's tokenizer) to F32 and Q8_0 and prints, per file, whether the engine's greedy tokens equal HF
``generate``'s from the same GGUF and, for F32, the safetensors model's. Not in the default suite (~2 min, a 77 MB
download the first time).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STORIES = ROOT / "resources" / "models" / "stories260K"
N = 24
PROMPT = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 79, 63, 115, 151]


def converter(cache: Path) -> Path | None:
    """``convert_hf_to_gguf.py`` unpacked from the cached sdist (fetched the first time); None when offline."""
    found = sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if found:
        return found[-1]
    cache.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "llama-cpp-python", "-d", str(cache)], capture_output=True, text=True, timeout=900)
    sdists = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    if r.returncode != 0 or not sdists:
        return None
    with tarfile.open(sdists[-1]) as t:
        keep = [m for m in t.getmembers() if "/vendor/llama.cpp/" in m.name and (
            m.name.endswith("/convert_hf_to_gguf.py") or "/gguf-py/" in m.name or "/conversion/" in m.name)]
        t.extractall(cache, members=keep)
    found = sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    return found[-1] if found else None


def folders(d: Path) -> dict[str, Path]:
    """stories260K and random llama / qwen2 / gemma2 folders with stories260K's tokenizer files."""
    from test_gguf import _random  # tests/engine: the same shapes as the default suite's

    out = {"stories": STORIES}
    for arch in ("llama", "qwen2", "gemma2"):
        f = d / arch
        _random(arch).save_pretrained(f)
        if arch == "gemma2":
            _gemma_vocab(f)
            continue
        for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
            shutil.copy(STORIES / name, f / name)
    return out | {a: d / a for a in ("llama", "qwen2", "gemma2")}


def _gemma_vocab(folder: Path) -> None:
    """A 512-piece SentencePiece model with Gemma's special pieces where Gemma has them (pad 0, eos 1, bos 2, unk
    3, mask 4), trained on the repository's READMEs: a Gemma GGUF's tokenizer adds any of those it lacks, which
    would not fit a 512-row embedding."""
    import json

    import sentencepiece as spm

    text = folder / "corpus.txt"
    text.write_text((ROOT / "README.md").read_text() + (ROOT / "engine" / "README.md").read_text())
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(folder / "tokenizer"), vocab_size=512,
                                   model_type="bpe", pad_id=0, eos_id=1, bos_id=2, unk_id=3,
                                   user_defined_symbols=["<mask>"], byte_fallback=True, minloglevel=2,
                                   pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>")
    (folder / "tokenizer.vocab").unlink()
    text.unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GemmaTokenizer"}))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "kvscope" / "llama-cpp-python")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "kvscope-llamacpp-gguf")
    a = p.parse_args()
    conv = converter(a.cache)
    if conv is None:
        print("skipped: llama-cpp-python's sdist is not cached and PyPI cannot be reached")
        return 0
    sys.path.insert(0, str(HERE))
    import torch
    from test_exact import engine_greedy, hf_greedy
    from test_gguf import _hf_from_gguf, _Wrap
    from transformers import AutoModelForCausalLM

    from engine.config import CacheConfig
    from engine.errors import EngineError
    from engine.model.loader import load_model

    a.dir.mkdir(parents=True, exist_ok=True)
    exact = 0
    rows = []
    for name, folder in folders(a.dir).items():
        source = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        for outtype in ("f32", "q8_0"):
            out = a.dir / f"{name}-{outtype}.gguf"
            r = subprocess.run([sys.executable, str(conv), str(folder), "--outtype", outtype, "--outfile", str(out)],
                               capture_output=True, text=True)  # its own vendored gguf-py, not ours
            if r.returncode != 0:
                rows.append(f"{name:8} {outtype:5} converter failed: {r.stderr.strip().splitlines()[-1][:150]}")
                continue
            try:
                lm = load_model(str(out))
            except EngineError as e:  # said as the app would say it
                rows.append(f"{name:8} {outtype:5} refused: {e}")
                continue
            got = engine_greedy(lm, PROMPT, N, CacheConfig(mode="paged", page_size=4))
            same_hf = got == hf_greedy(_Wrap(_hf_from_gguf(out)), PROMPT, N)
            same_st = got == hf_greedy(_Wrap(source), PROMPT, N) if outtype == "f32" else None
            exact += same_hf and same_st is not False
            rows.append(f"{name:8} {outtype:5} {out.stat().st_size / 1024:8.1f} KiB  engine == HF from GGUF: "
                        f"{same_hf}" + (f"  == safetensors: {same_st}" if same_st is not None else ""))
    print(f"llama.cpp converter: {conv.parts[-4]}")
    print("\n".join(rows))
    print(f"exact: {exact} of {len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
