"""An agent loop as a client runs it, against any OpenAI-compatible server: a system prompt with tool schemas (a
coding agent's twenty tools, ~3,000 tokens in Qwen2.5's tokenizer), then steps of a forced call (``tool_choice``
required) and its result sent back, each step streamed. Per step: prompt tokens, the tokens the server says it
reused (``cached_tokens``), what the previous step had fed it (its prompt and reply), and the time to the first
token (the first chunk after the role chunk).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

VERBS = ["read", "write", "list", "search", "run", "diff", "move", "delete", "create", "fetch"]
THINGS = ["file", "directory", "tests", "code", "commit", "branch", "issue", "log", "package", "config"]
SYSTEM = ("You are a careful coding agent working in a user's repository. Before you change anything, read the "
          "files involved and explain what you will do. Prefer small, reviewable changes, run the tests after each "
          "change, and never delete data without asking. Use the tools below; call one tool at a time and wait "
          "for its result. When you are done, summarise what you changed and why.")


def tools(n: int = 20) -> list[dict]:
    """``n`` function tools of a coding agent, each with a description and three to five described parameters."""
    out = []
    for i in range(n):
        verb, thing = VERBS[i % len(VERBS)], THINGS[(i * 3 + i // len(VERBS)) % len(THINGS)]
        props = {"path": {"type": "string", "maxLength": 24,
                          "description": f"Path of the {thing}, relative to the repository root."},
                 "reason": {"type": "string", "maxLength": 24,
                            "description": f"Why the agent needs to {verb} this {thing} now, in a few words."},
                 "dry_run": {"type": "boolean", "description": "Only say what would happen, change nothing."}}
        if i % 2:
            props["limit"] = {"type": "integer", "minimum": 1, "maximum": 500,
                              "description": "The most lines or entries to return."}
        if i % 3 == 0:
            props["mode"] = {"enum": ["fast", "thorough"], "description": "How hard to look before answering."}
        out.append({"type": "function", "function": {
            "name": f"{verb}_{thing}_{i}",
            "description": (f"{verb.title()} a {thing} of the repository. Use it when the task needs the {thing}'s "
                            f"current state; it returns a short report the agent can act on, or an error saying "
                            f"what went wrong (a missing {thing}, no permission, a timeout)."),
            "parameters": {"type": "object", "properties": props, "required": ["path", "reason"],
                           "additionalProperties": False}}})
    return out


@dataclass
class Step:
    step: int
    prompt_tokens: int
    cached_tokens: int
    previous_fed: int  # what the previous step fed the server: its prompt and its reply
    completion_tokens: int
    ttft_ms: float  # the chunk ``ttft_chunk`` names: the first one sent after the first token was computed
    total_ms: float
    call: str
    chunk0_ms: float = 0.0  # the role chunk's arrival
    chunk1_ms: float = 0.0  # the next chunk's
    metrics: dict | None = None  # the server's /metrics counters' growth over this step (``metrics_url``)

    @property
    def reuse_of_previous(self) -> float:
        return self.cached_tokens / self.previous_fed if self.previous_fed else 0.0


# vLLM's counters read around each step where its usage has no cached_tokens (and to check it where it has)
VLLM_COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                 "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count")


def read_counters(url: str, names=VLLM_COUNTERS) -> dict[str, float]:
    """The sums of ``names`` (over their labels) on a Prometheus text page."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


class Conversation:
    """One agent conversation against ``base_url`` (``.../v1``), a step at a time (sides of a measure alternate).

    ``ttft_chunk``: which streamed chunk marks the first token: 1 where the server sends the role chunk as the
    request arrives (this server), 0 where it sends it with the first token (vLLM). ``metrics_url``: a /metrics
    page read before and after each step (``Step.metrics``; its prefix-cache hits stand in for a missing
    ``cached_tokens``)."""

    def __init__(self, base_url: str, model: str, n_tools: int = 20, api_key: str = "unused",
                 max_tokens: int = 64, result_chars: int = 160, tag: str = "", ttft_chunk: int = 1,
                 metrics_url: str | None = None):
        import openai

        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=1200)
        self.model, self.max_tokens, self.result_chars = model, max_tokens, result_chars
        self.ttft_chunk, self.metrics_url = ttft_chunk, metrics_url
        self.tools = tools(n_tools)
        self.msgs = [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": f"The tests fail after the last commit{tag}: find out why and fix it."}]
        self.steps: list[Step] = []
        self.fed = 0

    def step(self) -> Step:
        k = len(self.steps)
        before = read_counters(self.metrics_url) if self.metrics_url else None
        t0 = time.perf_counter()
        arrived, calls, usage = [], {}, None
        stream = self.client.chat.completions.create(
            model=self.model, messages=self.msgs, tools=self.tools, tool_choice="required",
            max_tokens=self.max_tokens, temperature=0, stream=True, parallel_tool_calls=False,
            stream_options={"include_usage": True})
        for chunk in stream:
            if len(arrived) < 2:
                arrived.append(time.perf_counter())
            usage = chunk.usage or usage
            for ch in chunk.choices:
                for d in ch.delta.tool_calls or []:
                    got = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                    got["id"] = got["id"] or d.id
                    got["name"] = got["name"] or d.function.name
                    got["arguments"] += d.function.arguments or ""
        end = time.perf_counter()
        arrived += [end] * (2 - len(arrived))
        grew = None
        if before is not None:
            after = read_counters(self.metrics_url)
            grew = {n.split(":", 1)[1]: after[n] - before[n] for n in before}
        details = usage.prompt_tokens_details
        if details is not None and details.cached_tokens is not None:
            cached = details.cached_tokens
        elif grew is not None:
            cached = int(grew["prefix_cache_hits_total"])
        else:
            cached = 0
        call = calls.get(0) or {"id": f"call_{k}", "name": self.tools[0]["function"]["name"], "arguments": "{}"}
        ms = [1000 * (t - t0) for t in arrived]
        s = Step(k, usage.prompt_tokens, cached, self.fed, usage.completion_tokens, ms[self.ttft_chunk],
                 1000 * (end - t0), f"{call['name']}({call['arguments']})", ms[0], ms[1], grew)
        self.steps.append(s)
        self.fed = usage.prompt_tokens + usage.completion_tokens
        self.msgs += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"] or f"call_{k}", "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"]}}]},
            {"role": "tool", "tool_call_id": call["id"] or f"call_{k}",
             "content": (f"step {k}: " + "ok, 3 files match; " * 20)[:self.result_chars]}]
        return s


def run(base_url: str, model: str, n_tools: int = 20, steps: int = 10, api_key: str = "unused",
        max_tokens: int = 64, result_chars: int = 160, tag: str = "", **kw) -> list[Step]:
    """One agent conversation of ``steps`` steps against ``base_url`` (``.../v1``)."""
    conv = Conversation(base_url, model, n_tools, api_key, max_tokens, result_chars, tag, **kw)
    for _ in range(steps):
        conv.step()
    return conv.steps


def table(runs: dict[str, list[Step]]) -> str:
    """Markdown: per step, each server's reused / prompt, share of the previous step's feed reused, TTFT."""
    names = list(runs)
    head = "| step | " + " | ".join(f"{n} reused / prompt | {n} of previous | {n} TTFT ms" for n in names) + " |"
    rows = [head, "|" + "---|" * (1 + 3 * len(names))]
    for k in range(max(len(v) for v in runs.values())):
        cells = []
        for n in names:
            s = runs[n][k] if k < len(runs[n]) else None
            cells += ([f"{s.cached_tokens:,} / {s.prompt_tokens:,}",
                       f"{100 * s.reuse_of_previous:.1f}%" if k else "–", f"{s.ttft_ms:,.0f}"]
                      if s is not None else ["", "", ""])
        rows.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def as_json(runs: dict[str, list[Step]]) -> str:
    return json.dumps({n: [dict(asdict(s), reuse_of_previous=s.reuse_of_previous) for s in v]
                       for n, v in runs.items()}, indent=1)
