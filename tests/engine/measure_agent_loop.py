"""The agent-loop benchmark (``agent_loop``): the same conversation against ``engine serve`` with its prefix cache
and without it (``prefix_reuse`` off: every step prefills its whole prompt), each in this process on 127.0.0.1,
and against any other OpenAI-compatible server given with ``--peer`` (vLLM CPU with ``--enable-prefix-caching``).

    python tests/engine/measure_agent_loop.py --model smollm2 [--tools 20 --steps 10] [--json out.json]
    python tests/engine/measure_agent_loop.py --model stories --tools 4
    python tests/engine/measure_agent_loop.py --model smollm2 --folder DIR --build-only   # then vLLM serves DIR
    python tests/engine/measure_agent_loop.py --model smollm2 --folder DIR --peer http://127.0.0.1:8001/v1=vllm:NAME

Models: ``smollm2`` — the SmolLM2-135M shape (30 layers, hidden 576) over Qwen2.5's vocabulary and chat template,
random weights; ``stories`` — the shipped stories260K with Qwen2.5's template over its own 512-token vocabulary (about
a token a character: four tools make ~3,000 tokens), its context taken past the 512 positions it was trained at
(the cache's work is the same; the text is noise either way). Calls are forced (``tool_choice`` required), greedy.

vLLM CPU (its own venv, ``tests/remote/vllm_env.py``) serves the same folder with ``--dtype float32 --block-size 32
--max-model-len 8192 --enable-prefix-caching --enable-prompt-tokens-details --enable-auto-tool-choice
--tool-call-parser hermes`` (a forced call is refused without a parser), OMP_NUM_THREADS=1
VLLM_CPU_OMP_THREADS_BIND=nobind as this process's threads. It cannot serve stories260K: its CPU attention takes
head sizes 32 to 512, stories260K's is 8 (the first request fails: "Unsupported CPU attention configuration").
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


def serve(folder: Path, reuse: bool):
    """(the server's thread, its base URL, its model id): ``engine serve``'s server on 127.0.0.1, in this process."""
    from engine.config import CacheConfig
    from engine.model.loader import load_model
    from engine.server import KVServer, ServerOptions, ServerThread

    lm = load_model(str(folder))
    server = KVServer(lm, CacheConfig(page_size=16, prefix_reuse=reuse), ServerOptions(), source=str(folder))
    thread = ServerThread(server)
    return thread, thread.start() + "/v1", server.model_id


def summary(runs: dict, ours: str = "kvscope", full: str = "no reuse") -> list[str]:
    """Per side: the least reuse of the previous step's feed after the first step, the median TTFT of those steps
    and its ratio to a full prefill's (the side without reuse, step by step); ours against each other side."""
    lines = []
    base = runs[full][1:]
    for name, steps in runs.items():
        later = steps[1:]
        worst = min(s.reuse_of_previous for s in later)
        ratio = statistics.median(s.ttft_ms / f.ttft_ms for s, f in zip(later, base))
        lines.append(f"{name}: steps after the first reuse at least {100 * worst:.1f}% of the previous step's feed; "
                     f"median TTFT {statistics.median(s.ttft_ms for s in later):,.0f} ms against a full prefill's "
                     f"{statistics.median(f.ttft_ms for f in base):,.0f} ms (x{ratio:.3f})")
    for name, steps in runs.items():
        if name not in (ours, full):
            r = statistics.median(p.ttft_ms / o.ttft_ms for o, p in zip(runs[ours][1:], steps[1:]))
            lines.append(f"{ours} against {name}: median of its TTFT / ours over the steps after the first x{r:.2f} "
                         f"(>= 1: ours no slower)")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("smollm2", "stories"), default="smollm2")
    ap.add_argument("--folder", help="the model folder: built there when empty (a --peer serves the same one)")
    ap.add_argument("--build-only", action="store_true", help="build --folder and stop")
    ap.add_argument("--tools", type=int, default=20)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--peer", action="append", default=[], help="URL=NAME:MODEL of another server (a NAME "
                    "starting 'vllm': its role chunk marks the first token and its /metrics is read each step)")
    ap.add_argument("--json")
    a = ap.parse_args()
    from engine.core import grammar

    folder = Path(a.folder) if a.folder else Path(tempfile.mkdtemp(prefix="agent-loop-"))
    if not (folder / "config.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        model_folder(a.model, folder)
    if a.build_only:
        return 0
    # every side serves at once and the sides take a step each in turn (the order turning each step), so a busy
    # spell of the host falls on all of them alike
    sides: dict[str, dict] = {}
    threads = []
    try:
        for name, reuse in (("kvscope", True), ("no reuse", False)):
            thread, url, model = serve(folder, reuse)
            threads.append(thread)
            sides[name] = {"url": url, "model": model, "ttft_chunk": 1, "metrics_url": None}
        for peer in a.peer:
            url, _, rest = peer.partition("=")
            name, _, model = rest.partition(":")
            vllm = name.startswith("vllm")
            sides[name] = {"url": url, "model": model, "ttft_chunk": 0 if vllm else 1,
                           "metrics_url": url.rstrip("/").removesuffix("/v1") + "/metrics" if vllm else None}
        for name, side in sides.items():  # imports, first forwards, compiled paths: one step each, apart
            agent_loop.run(side["url"], side["model"], a.tools, 1, tag=" (warm-up)", ttft_chunk=side["ttft_chunk"])
        convs = {name: agent_loop.Conversation(side["url"], side["model"], a.tools, max_tokens=a.max_tokens,
                                               ttft_chunk=side["ttft_chunk"], metrics_url=side["metrics_url"])
                 for name, side in sides.items()}
        before = dict(grammar.TOTALS)
        names = list(convs)
        for k in range(a.steps):
            for name in names[k % len(names):] + names[:k % len(names)]:
                s = convs[name].step()
                print(f"step {k} {name}: {s.cached_tokens:,} of {s.prompt_tokens:,} reused, TTFT {s.ttft_ms:,.0f} ms",
                      flush=True)
        used = {k: grammar.TOTALS[k] - before[k] for k in before}
    finally:
        for thread in threads:
            thread.stop()
    runs = {name: conv.steps for name, conv in convs.items()}
    print(agent_loop.table(runs))
    print("\n" + "\n".join(summary(runs)))
    if used["tokens"]:
        print(f"grammar (both of this server's sides): {used['tokens']} constrained tokens, mask "
              f"{1e6 * used['mask_s'] / used['tokens']:.0f} us a token computed, "
              f"{1e6 * used['wait_s'] / used['tokens']:.0f} us a token waited for by the sampler")
    if a.json:
        Path(a.json).write_text(agent_loop.as_json(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
