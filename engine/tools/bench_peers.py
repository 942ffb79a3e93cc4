"""Side by side against any OpenAI-compatible server: ``engine serve``, vLLM, llama.cpp's server, ...

    python -m engine.tools.bench_peers http://127.0.0.1:8000 http://127.0.0.1:8001 --names kvscope,vllm \\
        --clients 1,4,16 --prompt-tokens 128 --new-tokens 128 --shared-prefix 1000 --rounds 3 --json peers.json

Each round runs every server in turn (interleaved: a shared machine's load drifts over minutes, so a server
measured an hour after another is not compared with it), each scenario in turn:

- ``streams`` at each client count: that many streamed completions sent at once, each its own prompt of
  ``--prompt-tokens`` token ids (the same ids for every server): tokens per second of all of them together (first
  request sent to last token), the median stream's decode rate after its first token and the median time to it.
- ``shared-prefix``: a system prefix of ``--shared-prefix`` tokens (a new one each round: never cached before)
  with a question of its own for each of ``--prefix-requests`` requests, one after another: the first request's
  time to its first token (it computes the prefix) and the others' (a server with prefix caching reads it), with
  ``cached_tokens`` where the server reports it.

Prompts are token ids below ``--vocab`` (500: inside any tokenizer), temperature 0, ``ignore_eos`` / ``min_tokens``
asked (vLLM and llama.cpp honour them; a server that stops early is measured on the tokens it sent:
``usage.completion_tokens``). Medians over rounds; every figure also as a ratio to the first server's in the same
run. ``--warmup`` rounds come first on prompts of their own and are not counted; the rounds' prompts follow
``--seed``: a server that ran the bench before holds the last run's prompts in its prefix cache, so give another
seed or restart it. Bad arguments or a server that does not answer: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

QUESTION = 16  # tokens of each shared-prefix request's own question


@dataclass
class Stream:
    """One streamed completion as a client saw it (seconds since the scenario began)."""

    sent: float
    first: float | None = None
    end: float = 0.0
    tokens: int = 0
    cached: int | None = None
    error: str = ""


class Peer:
    """One server: its URL, the model it serves, a name for the table."""

    def __init__(self, url: str, name: str, api_key: str | None, timeout: float) -> None:
        import httpx

        self.url, self.name = url.rstrip("/"), name
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, timeout=timeout)
        self.model = ""

    def connect(self, model: str | None) -> None:
        """The served model (``GET /v1/models``: the first, or the one named)."""
        r = self.http.get(f"{self.url}/v1/models")
        r.raise_for_status()
        ids = [m.get("id") for m in r.json().get("data", []) if isinstance(m, dict)]
        if not ids:
            raise ValueError(f"{self.url} serves no model (GET /v1/models)")
        if model and model not in ids:
            raise ValueError(f"{self.url} does not serve {model!r} (it serves {', '.join(map(str, ids))})")
        self.model = model or ids[0]

    def stream(self, prompt: list[int], new_tokens: int, t0: float) -> Stream:
        """One streamed completion of ``prompt``; what it cost, as seen from here."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True, "min_tokens": new_tokens}
        s = Stream(sent=time.perf_counter() - t0)
        chunks = 0
        try:
            with self.http.stream("POST", f"{self.url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    s.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                    return s
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    # a token's event: text, or none yet (a character's bytes held back) and not the finish
                    if any(c.get("text") or c.get("finish_reason") is None for c in data.get("choices") or []):
                        chunks += 1
                        if s.first is None:
                            s.first = time.perf_counter() - t0
                    usage = data.get("usage")
                    if usage:
                        s.tokens = int(usage.get("completion_tokens") or 0)
                        details = usage.get("prompt_tokens_details") or {}
                        s.cached = details.get("cached_tokens")
        except Exception as e:  # noqa: BLE001 - a failed stream is reported, the run goes on
            s.error = f"{type(e).__name__}: {e}"[:200]
        s.end = time.perf_counter() - t0
        s.tokens = s.tokens or chunks
        return s


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def streams(peer: Peer, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """``len(prompts)`` completions sent at once: aggregate tokens/s, median decode rate and time to first token."""
    start = threading.Barrier(len(prompts))
    t0 = time.perf_counter()

    def one(p):
        start.wait()
        return peer.stream(p, new_tokens, t0)

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, prompts))
    errors = [s.error for s in got if s.error]
    if errors:
        return {"error": errors[0], "failed": len(errors)}
    wall = max(s.end for s in got) - min(s.sent for s in got)
    decode = [(s.tokens - 1) / (s.end - s.first) for s in got
              if s.first is not None and s.tokens > 1 and s.end > s.first]
    ttft = [(s.first - s.sent) * 1000 for s in got if s.first is not None]
    return {"tokens": sum(s.tokens for s in got), "tokens_per_s": sum(s.tokens for s in got) / wall if wall else 0.0,
            "stream_decode_tokens_per_s": statistics.median(decode) if decode else 0.0,
            "ttft_ms": statistics.median(ttft) if ttft else 0.0}


def shared_prefix(peer: Peer, prefix: list[int], questions: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Requests sharing ``prefix``, one after another: the first's time to first token, the others' median."""
    got = [peer.stream(prefix + q, new_tokens, time.perf_counter()) for q in questions]
    errors = [s.error for s in got if s.error]
    if errors or any(s.first is None for s in got):
        return {"error": errors[0] if errors else "a request sent no token"}
    ttft = [(s.first - s.sent) * 1000 for s in got]
    rest = statistics.median(ttft[1:]) if len(ttft) > 1 else ttft[0]
    cached = [s.cached for s in got[1:] if s.cached is not None]
    return {"first_ttft_ms": ttft[0], "rest_ttft_ms": rest, "rest_over_first": rest / ttft[0] if ttft[0] else None,
            "rest_cached_tokens": statistics.median(cached) if cached else None}


def run(peers: list[Peer], a) -> dict[str, Any]:
    """The warm-up rounds (not counted), then every round: every server, every scenario; then medians and ratios
    to the first server."""
    raw: dict[str, dict[str, list[dict]]] = {p.name: {} for p in peers}
    for w in range(a.warmup):
        one_round(peers, a, random.Random(f"warm-up {a.seed} {w}"), {p.name: {} for p in peers}, f"warm-up {w + 1}")
    for r in range(a.rounds):
        # the same prompts for every server in a round, new ones each round (and each --seed: a server that ran
        # this bench before has the last run's prompts in its prefix cache)
        one_round(peers, a, random.Random(a.seed + r), raw, f"round {r + 1}")
    return summarize(raw, [p.name for p in peers])


def one_round(peers: list[Peer], a, rng: random.Random, raw: dict[str, dict[str, list[dict]]], label: str) -> None:
    """Every server, every scenario, on prompts drawn from ``rng``; the results appended to ``raw``."""
    prompts = {c: [_ids(rng, a.prompt_tokens, a.vocab) for _ in range(c)] for c in a.clients}
    prefix = _ids(rng, a.shared_prefix, a.vocab) if a.shared_prefix else []
    questions = [_ids(rng, QUESTION, a.vocab) for _ in range(a.prefix_requests)]
    for p in peers:
        for c in a.clients:
            res = streams(p, prompts[c], a.new_tokens)
            raw[p.name].setdefault(f"streams_{c}", []).append(res)
            _say(a, f"{label} {p.name} {c} client(s): {_line(res)}")
        if prefix:
            res = shared_prefix(p, prefix, questions, a.new_tokens)
            raw[p.name].setdefault("shared_prefix", []).append(res)
            _say(a, f"{label} {p.name} shared prefix: {_line(res)}")


def summarize(raw: dict[str, dict[str, list[dict]]], names: list[str]) -> dict[str, Any]:
    """Medians of each figure over the rounds that did not fail; ratios of each server to the first."""
    med: dict[str, dict[str, dict[str, float]]] = {}
    for name in names:
        for scen, runs in raw[name].items():
            ok = [x for x in runs if "error" not in x]
            keys = {k for x in ok for k, v in x.items() if isinstance(v, (int, float)) and v is not None}
            fig = {k: statistics.median([x[k] for x in ok if x.get(k) is not None]) for k in sorted(keys)}
            if len(ok) < len(runs):
                fig["failed_rounds"] = len(runs) - len(ok)
                fig["error"] = next(x["error"] for x in runs if "error" in x)
            med.setdefault(name, {})[scen] = fig
    ref = names[0]
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for name in names[1:]:
        for scen, fig in med.get(name, {}).items():
            base = med.get(ref, {}).get(scen, {})
            ratios.setdefault(name, {})[scen] = {k: round(v / base[k], 4) for k, v in fig.items()
                                                 if isinstance(v, (int, float)) and base.get(k)}
    return {"reference": ref, "medians": med, "ratios_to_reference": ratios, "rounds": raw}


def _line(res: dict) -> str:
    if "error" in res:
        return f"failed: {res['error']}"
    return ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in res.items() if v is not None)


def _say(a, text: str) -> None:
    if not a.quiet:
        print(text, flush=True)


def table(result: dict[str, Any]) -> str:
    """Markdown: one row per scenario and figure, one column per server, ratios to the first."""
    names = list(result["medians"])
    ref = result["reference"]
    head = "| scenario | figure | " + " | ".join(names) + " | " + " | ".join(f"{n} ÷ {ref}" for n in names[1:]) + " |"
    rows = [head, "|" + "---|" * (2 + 2 * len(names) - 1)]
    scens = sorted({s for n in names for s in result["medians"][n]}, key=lambda s: (len(s), s))
    for scen in scens:
        figs = sorted({k for n in names for k in result["medians"][n].get(scen, {}) if k != "error"})
        for k in figs:
            vals = [result["medians"][n].get(scen, {}).get(k) for n in names]
            rat = [result["ratios_to_reference"].get(n, {}).get(scen, {}).get(k) for n in names[1:]]
            cells = [f"{v:,.1f}" if isinstance(v, (int, float)) else "—" for v in vals]
            cells += [f"×{r:.2f}" if isinstance(r, (int, float)) else "—" for r in rat]
            rows.append(f"| {scen} | {k} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints its usage too)
        print(f"bench_peers: {message}", file=sys.stderr)
        sys.exit(2)


def parse(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog="python -m engine.tools.bench_peers", description=__doc__.split("\n\n")[0])
    p.add_argument("urls", nargs="+", help="servers, http(s)://HOST:PORT (the first is the reference of the ratios)")
    p.add_argument("--names", default="", help="their names in the table, comma separated (default: host:port)")
    p.add_argument("--model", default=None, help="the model to ask for (default: each server's first)")
    p.add_argument("--api-key", default=None, help="Authorization: Bearer KEY for every server")
    p.add_argument("--clients", default="1,4,16", help="concurrent streams, comma separated")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--shared-prefix", type=int, default=1000, help="tokens of the shared prefix (0: skip it)")
    p.add_argument("--prefix-requests", type=int, default=4, help="requests sharing it, one after another")
    p.add_argument("--vocab", type=int, default=500, help="prompt ids are drawn from 3 .. VOCAB-1")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=0,
                   help="rounds first on prompts of their own, not counted (compiles, caches, thread pools)")
    p.add_argument("--seed", type=int, default=1000,
                   help="the rounds' prompts (round r: SEED + r); change it for servers that ran this bench before")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--json", dest="json_file", default=None, help="write the result here")
    p.add_argument("--quiet", action="store_true", help="print only the table")
    a = p.parse_args(argv)
    try:
        a.clients = [int(x) for x in a.clients.split(",") if x.strip()]
    except ValueError:
        p.error(f"--clients: {a.clients!r} is not a comma-separated list of numbers")
    hosts = [u.split("://", 1)[-1].rstrip("/") for u in a.urls]
    a.names = [n.strip() for n in a.names.split(",")] if a.names else hosts
    checks = [(not a.clients or min(a.clients) < 1 or max(a.clients) > 256, "--clients: each 1..256"),
              (len(a.names) != len(a.urls), f"--names: {len(a.names)} names for {len(a.urls)} servers"),
              (len(set(a.names)) != len(a.names), "--names: each server needs a name of its own"),
              (a.prompt_tokens < 1 or a.new_tokens < 1, "--prompt-tokens and --new-tokens: at least 1"),
              (a.shared_prefix < 0 or a.prefix_requests < 2, "--shared-prefix >= 0 and --prefix-requests >= 2"),
              (a.vocab < 4, "--vocab: at least 4"), (a.rounds < 1, "--rounds: at least 1"),
              (a.warmup < 0, "--warmup: 0 or more"),
              (any(not u.startswith(("http://", "https://")) for u in a.urls), "a server is http(s)://HOST:PORT")]
    for bad, why in checks:
        if bad:
            p.error(why)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    peers = [Peer(u, n, a.api_key, a.timeout) for u, n in zip(a.urls, a.names)]
    for p in peers:
        try:
            p.connect(a.model)
        except Exception as e:  # noqa: BLE001 - one line, no traceback
            print(f"bench_peers: {p.url}: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
            return 2
    result = run(peers, a)
    result["settings"] = {k: getattr(a, k) for k in ("urls", "names", "clients", "prompt_tokens", "new_tokens",
                                                    "shared_prefix", "prefix_requests", "rounds", "warmup", "seed")}
    result["models"] = {p.name: p.model for p in peers}
    print(table(result), flush=True)
    if a.json_file:
        with open(a.json_file, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
