"""``python -m engine models``: the models on this machine (the Hugging Face cache, LM Studio, Ollama and the folders
named with ``--folder``; ``engine.model.catalog``) with, for each, its store, format, size on disk, the memory its
weights will take as they will be held, the KV cache's bytes per token and the longest context that fits in the
memory free now (``engine.model.fit``), before anything is loaded."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_parser(sub, model_args) -> None:
    m = sub.add_parser("models", help="the models on this machine: store, format, size on disk and in memory, "
                       "KV bytes per token and the longest context that fits")
    m.add_argument("--folder", action="append", default=[], metavar="DIR",
                   help="also look in this folder (repeatable; models below it, GGUF files and model folders)")
    m.add_argument("--kv-dtype", default="auto", choices=("auto", "int8", "int4", "tq4", "tq3", "tq2"),
                   help="the K/V precision the table's KV columns are for (the JSON has every one)")
    model_args(m)
    m.add_argument("--json", action="store_true", help="print one JSON object")


def _row(found, spec, device: str, available: int, source: str) -> dict:
    from engine.model import fit

    row = {"name": found.name, "store": found.store.value, "source": found.source, "kind": found.kind,
           "disk_bytes": found.size_bytes, "stored_format": found.weights_type, "problem": found.problem}
    if found.problem:
        return row
    try:
        f = fit.estimate_path(Path(found.source), spec, device, available, source, found.name)
    except Exception as e:  # noqa: BLE001 - a file that changed since the scan: its line says so
        row["problem"] = str(e).splitlines()[0] if str(e) else type(e).__name__
        return row
    w = f.weights
    row.update(format=w.format, stored_format=w.stored, held=str(w.held), bits_per_weight=round(w.bits_per_weight, 2),
               memory_bytes=w.bytes, resident_bytes=f.resident_bytes, load_bytes=f.load_bytes, context=f.context,
               compute_dtype=f.compute_dtype, fits=f.fits,
               kv={k.kind: {"bytes_per_token": round(k.bytes_per_token, 1), "longest_context": k.longest_context}
                   for k in f.kv})
    return row


def run_models(a: argparse.Namespace) -> int:
    from engine.config import ModelSpec
    from engine.model import catalog, fit
    from engine.model.fit_check import human_bytes
    from engine.model.loader import choose_device

    spec = ModelSpec(source="models", quantization=a.quantize, device=a.device, dtype=a.dtype,
                     allow_pickle=a.allow_pickle, trust_remote_code=a.trust_remote_code)
    for folder in a.folder:
        if not Path(folder).expanduser().is_dir():
            raise ValueError(f"--folder {folder}: not a folder")
    device, _ = choose_device(spec.device)
    available, source = fit.available_memory(device)
    found = catalog.scan(a.folder)
    notes = list(getattr(found, "notes", ()))  # a walk cut short, a store that could not be read
    rows = [_row(m, spec, device, available, source) for m in getattr(found, "models", found)]
    if a.json:
        print(json.dumps({"device": device, "available_bytes": available, "available_from": source,
                          "models": rows, "notes": notes}))
        return 0
    print(f"{len(rows)} models; {human_bytes(available)} of {source} ({device})")
    for r in rows:
        print(_line(r, a.kv_dtype))
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return 0


def _line(r: dict, kind: str) -> str:
    from engine.model.fit_check import human_bytes

    head = f"{r['name']}  [{r['store']}]  {human_bytes(r['disk_bytes'])} on disk"
    if r["problem"]:
        return f"{head}  -- {r['problem']}"
    k = r["kv"][kind]
    dtype = r["compute_dtype"] if kind == "auto" else kind
    verdict = "fits" if r["fits"] else "does not fit"
    conv = "" if r["format"] == r["stored_format"] else f" from {r['stored_format']}"
    return (f"{head}  {r['format']}{conv} ({r['bits_per_weight']:.2f} bits/weight, {r['held']}): "
            f"{human_bytes(r['memory_bytes'])} in memory  KV {human_bytes(k['bytes_per_token'])}/token ({dtype})  "
            f"longest context {k['longest_context']:,} of {r['context']:,}  {verdict}")
