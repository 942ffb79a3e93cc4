"""The agent-loop benchmark (``agent_loop``): the same conversation against ``engine serve`` with its prefix cache
and without it (``prefix_reuse`` off: every step prefills its whole prompt), each in this process on 127.0.0.1,
and against any other OpenAI-compatible server given with ``--peer`` (vLLM CPU with ``--enable-prefix-caching``).

    python tests/engine/measure_agent_loop.py --model smollm2 [--tools 20 --steps 10] [--json out.json]
    python tests/engine/measure_agent_loop.py --model stories --tools 4
    python tests/engine/measure_agent_loop.py --model smollm2 --peer http://127.0.0.1:8001/v1=vllm:MODEL

Models: ``smollm2`` — the SmolLM2-135M shape (30 layers, hidden 576) over Qwen2.5's vocabulary and chat template,
random weights; ``stories`` — the shipped stories260K with Qwen2.5's template over its own 512-token vocabulary (about
a token a character: four tools make ~3,000 tokens), its context taken past the 512 positions it was trained at
(the cache's work is the same; the text is noise either way). Calls are forced (``tool_choice`` required), greedy.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import agent_loop  # noqa: E402
from tool_models import qwen_tokenizer, template  # noqa: E402


def model_folder(kind: str, where: Path) -> Path:
    if kind == "stories":
        src = Path(__file__).resolve().parents[2] / "resources" / "models" / "stories260K"
        shutil.copytree(src, where, dirs_exist_ok=True)
        (where / "chat_template.jinja").write_text(template("qwen2.5"))
        import json

        tc = where / "tokenizer_config.json"  # a template in the config would win over the file
        if tc.exists():
            d = json.loads(tc.read_text())
            d.pop("chat_template", None)
            tc.write_text(json.dumps(d))
        cfg = json.loads((where / "config.json").read_text())  # trained at 512 positions; RoPE runs on past them
        cfg["max_position_embeddings"] = 8192
        (where / "config.json").write_text(json.dumps(cfg))
        return where
    import torch
    from transformers import AutoModelForCausalLM

    from engine.model.shapes import build_config

    cfg = build_config("smollm2-135m")
    cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id = 151936, 151643, 151645
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, 8192)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = [151645, 151643]
    model.save_pretrained(where)
    qwen_tokenizer(where).save_pretrained(where)
    return where


def serve_and_run(folder: Path, reuse: bool, a) -> list:
    from engine.config import CacheConfig
    from engine.model.loader import load_model
    from engine.server import KVServer, ServerOptions, ServerThread

    lm = load_model(str(folder))
    server = KVServer(lm, CacheConfig(page_size=16, prefix_reuse=reuse), ServerOptions(), source=str(folder))
    thread = ServerThread(server)
    url = thread.start()
    try:
        agent_loop.run(url + "/v1", server.model_id, a.tools, 1, tag=" (warm-up)")  # imports, first forwards
        return agent_loop.run(url + "/v1", server.model_id, a.tools, a.steps, max_tokens=a.max_tokens)
    finally:
        thread.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("smollm2", "stories"), default="smollm2")
    ap.add_argument("--tools", type=int, default=20)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--peer", action="append", default=[], help="URL=NAME:MODEL of another server")
    ap.add_argument("--json")
    a = ap.parse_args()
    from engine.core import grammar

    folder = model_folder(a.model, Path(tempfile.mkdtemp(prefix="agent-loop-")))
    runs = {}
    before = dict(grammar.TOTALS)
    runs["kvscope"] = serve_and_run(folder, True, a)
    used = {k: grammar.TOTALS[k] - before[k] for k in before}
    runs["no reuse"] = serve_and_run(folder, False, a)
    for peer in a.peer:
        url, _, rest = peer.partition("=")
        name, _, model = rest.partition(":")
        runs[name] = agent_loop.run(url, model, a.tools, a.steps, max_tokens=a.max_tokens)
    print(agent_loop.table(runs))
    ours, full = runs["kvscope"][1:], runs["no reuse"][1:]
    worst = min(s.reuse_of_previous for s in ours)
    ratio = statistics.median(s.ttft_ms / f.ttft_ms for s, f in zip(ours, full))
    print(f"\nsteps after the first: least reuse of the previous step's feed {100 * worst:.1f}%; median TTFT "
          f"{statistics.median(s.ttft_ms for s in ours):,.0f} ms against a full prefill's "
          f"{statistics.median(f.ttft_ms for f in full):,.0f} ms (x{ratio:.3f})")
    if used["tokens"]:
        print(f"grammar: {used['tokens']} constrained tokens, mask {1e6 * used['mask_s'] / used['tokens']:.0f} us "
              f"a token computed, {1e6 * used['wait_s'] / used['tokens']:.0f} us a token waited for by the sampler")
    if a.json:
        Path(a.json).write_text(agent_loop.as_json(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
