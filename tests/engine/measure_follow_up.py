"""Follow-up reuse over HTTP per tokenizer (#49 item 5): ``python tests/engine/measure_follow_up.py VOCAB.gguf[.gz] ...``
prints, per vocabulary, the share of the previous prompt + reply each follow-up found cached (4 turns, the reply's
text sent back), with the reply's first token decoded after the prompt's last ids (now) and alone (before: context 0).
A tiny random Llama of the vocabulary's size; the template is the vocabulary's own, else a plain one."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402

import test_follow_up_tokenizers as t  # noqa: E402
from engine.config import CacheConfig  # noqa: E402
from engine.model import chat  # noqa: E402
from engine.server import KVServer, ServerOptions, ServerThread  # noqa: E402


def run(folder: Path, name: str) -> list[float]:
    from engine.model.loader import load_model

    server = KVServer(load_model(str(folder)), CacheConfig(page_size=16), ServerOptions(), source=str(folder))
    thread = ServerThread(server)
    url = thread.start()
    convo, out = [], []
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            for turn, text in enumerate(t.TURNS):
                convo.append({"role": "user", "content": text})
                body = c.post("/v1/chat/completions", json={"model": name, "messages": convo, "max_tokens": 40,
                                                            "temperature": 0.8, "seed": turn}).json()
                if turn:
                    out.append(body["usage"]["prompt_tokens_details"]["cached_tokens"] / was)
                was = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
                convo.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    finally:
        thread.stop()
    return out


if __name__ == "__main__":
    for path in map(Path, sys.argv[1:]):
        name = path.name.removeprefix("ggml-vocab-").split(".gguf")[0]
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / f"ggml-vocab-{name}.gguf.gz"
            if path.suffix == ".gz":
                src.write_bytes(path.read_bytes())
            else:
                import gzip

                src.write_bytes(gzip.compress(path.read_bytes(), 1))
            t.VOCAB = Path(tmp)
            folder = t._folder(Path(tmp), name)
            for label, context in (("before (reply decoded alone)", 0), ("now", chat.CONTEXT_IDS)):
                keep, chat.CONTEXT_IDS = chat.CONTEXT_IDS, context
                try:
                    reuse = run(folder, name)
                finally:
                    chat.CONTEXT_IDS = keep
                print(f"{name}: {label}: " + ", ".join(f"{100 * r:.0f}%" for r in reuse), flush=True)
