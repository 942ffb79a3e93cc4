"""How close the kept-block model's logits are to its two references, per GGUF file: the float32 model the ``gguf``
package dequantizes from the file (transformers' ``from_pretrained(dir, gguf_file=...)``) and llama.cpp's logits
on the same file; and whether the greedy tokens agree.

    python tests/engine/measure_gguf_logits.py --llama-python PYTHON_WITH_LLAMA_CPP FILE.gguf [FILE.gguf ...]
        [--prompt 64] [--new 16]

For each file: max relative error (max |a - b| / max |b| over the prompt's logits) of the engine's model with
float activations (``float`` road) and with 8-bit ones (``int8``, the default) against the dequantized model and
against llama.cpp, and the number of greedy tokens (of ``--new``) each side shares with the other from the start.
Not in the default suite (loads a float32 copy of each model).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def prompt(n: int) -> list[int]:
    return [1] + [(i * 7) % 500 + 3 for i in range(n - 1)]


def llama_side(path: str, n: int, new: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=n + new + 16, n_threads=2, n_batch=512, verbose=False,
                          logits_all=True)
    ids = prompt(n)
    llm.eval(ids)
    logits = np.array(llm.scores[:n], dtype=np.float32)  # [n, vocab]
    toks = []
    tok = int(logits[-1].argmax())
    for _ in range(new):
        toks.append(tok)
        llm.eval([tok])
        tok = int(np.array(llm.scores[llm.n_tokens - 1]).argmax())
    return {"logits": logits.tolist(), "tokens": toks}


def greedy(model, ids: list[int], new: int) -> list[int]:
    import torch

    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def ours(path: Path, road: str, n: int, new: int):
    import torch

    os.environ["KVSCOPE_GGUF_ROAD"] = road
    from engine.model.gguf_file import read_gguf
    from engine.quant.gguf_keep import load
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=str(path))
    model = load(path, read_gguf(path), config, torch.float32, "cpu")
    with torch.inference_mode():
        logits = model(torch.tensor([prompt(n)])).logits[0].numpy()
    return logits, greedy(model, prompt(n), new)


def shared(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*")
    ap.add_argument("--llama-python", default="")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--child", nargs=3)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(llama_side(a.child[0], int(a.child[1]), int(a.child[2]))))
        return
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(2)
    for f in map(Path, a.files):
        ref = AutoModelForCausalLM.from_pretrained(str(f.parent), gguf_file=str(f), dtype=torch.float32).eval()
        with torch.inference_mode():
            ref_logits = ref(torch.tensor([prompt(a.prompt)])).logits[0].numpy()
        ref_tokens = greedy(ref, prompt(a.prompt), a.new)
        del ref
        lc = None
        if a.llama_python:
            r = subprocess.run([a.llama_python, __file__, "--child", str(f), str(a.prompt), str(a.new)],
                               capture_output=True, text=True, timeout=1800)
            lc = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
        row = {"file": f.name}
        for road in ("float", "int8"):
            logits, toks = ours(f, road, a.prompt, a.new)
            row[road] = {"vs_dequantized": rel(logits, ref_logits), "tokens_shared_dequantized": shared(toks, ref_tokens)}
            if lc:
                row[road]["vs_llama_cpp"] = rel(logits, np.array(lc["logits"], dtype=np.float32))
                row[road]["tokens_shared_llama_cpp"] = shared(toks, lc["tokens"])
        if lc:
            row["llama_cpp_vs_dequantized"] = rel(np.array(lc["logits"], dtype=np.float32), ref_logits)
            row["llama_cpp_tokens_shared_dequantized"] = shared(lc["tokens"], ref_tokens)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
