"""Every user-facing name and description, in one table.

The cache controls, their tooltips, the status bar, the context readout, the stop marks under replies and
the help dialogs all read these entries, so a setting is called the same thing everywhere and its tooltip
says what it does to memory, speed and quality. Engine ids ("streaming", "truncate_middle", ...) never
reach the user except in brackets after a plain name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Term:
    """One choice or control: ``name`` (controls, help), ``short`` (status bar), ``tip`` (tooltip: what it
    does to memory, speed and quality)."""

    name: str
    short: str
    tip: str


MODES = {
    "paged": Term("Paged", "paged cache",
                  "Keeps keys and values in fixed-size pages from a pool shared by your chats.\n"
                  "Memory: grows one page at a time; chats that start alike share pages.\n"
                  "Speed: as fast as contiguous.  Quality: exact (lossless)."),
    "contiguous": Term("Contiguous", "contiguous cache",
                       "Keeps keys and values in one growing buffer per layer.\n"
                       "Memory: the whole buffer, no sharing between chats.\n"
                       "Speed: fast, constant work per token.  Quality: exact (lossless)."),
    "off": Term("Off (recompute everything)", "no cache",
                "Keeps nothing: every new token recomputes the whole conversation.\n"
                "Memory: none for the cache.  Speed: gets slower with every token (quadratic).\n"
                "Quality: exact. Useful to see what a cache saves."),
}

KV_DTYPES = {
    "auto": Term("Full precision", "full precision",
                 "Stores this half of the cache at the model's own precision (its dtype).\n"
                 "Memory: the most.  Speed: the fastest.  Quality: exact."),
    "int8": Term("8-bit (int8)", "8-bit",
                 "Stores full pages as 8-bit codes with a scale per token (keys per channel where cheaper).\n"
                 "Memory: about a third of float32, half of float16.  Speed: a little slower (decoding the codes).\n"
                 "Quality: near-exact (usually the same words)."),
    "int4": Term("4-bit (int4, KIVI)", "4-bit",
                 "Stores full pages as 4-bit codes (KIVI: keys per channel, values per token); the page being "
                 "filled stays exact.\nMemory: about a quarter of float32.  Speed: decoding reads the codes in a "
                 "fused kernel (built once with the machine's C compiler): about as fast as full precision at "
                 "2,048 tokens; without a compiler, slower (decoding the codes).\n"
                 "Quality: small drift; long replies may diverge."),
    **{f"tq{b}": Term(f"{b}-bit rotated (tq{b})", f"{b}-bit rotated",
                      "TurboQuant: turns each key or value by a random rotation, then keeps "
                      f"{b} bits a number from a codebook made for rotated vectors, and the vector's length; the "
                      "page being filled stays exact.\n"
                      f"Memory: {ratio} of 16-bit at head size 64 (int4: 0.34).  Speed: decoding reads the "
                      "codes in a fused kernel (built once with the machine's C compiler): about as fast as full "
                      "precision at 2,048 tokens; without a compiler, slower than int4.\n"
                      f"Quality: {quality}")
       for b, ratio, quality in (
           (4, "0.27", "values near-exact; keys lose more than int4's on small heads (stories260K's 8)."),
           (3, "0.20", "values close (4-bit keys with these values: near-exact on stories260K at 0.2 of "
                       "float32); keys drift on small heads."),
           (2, "0.14", "coarse: for values, or to see what low bits cost."))},
    **{f"tq{b}-qjl": Term(f"{b}-bit rotated + QJL", f"{b}-bit rotated + QJL",
                          f"Keys only: {b - 1} bits of codebook and a 1-bit sign of what they missed (QJL, "
                          "TurboQuant's inner-product form), so query·key is right on average.\n"
                          f"Memory: as tq{b} plus one number a vector.  Speed: a little slower than tq{b} "
                          "(the signs are read too: about 0.9 of full precision at 2,048 tokens).\n"
                          "Quality: unbiased but noisier than tq at the same bits: attention's softmax "
                          "amplifies the noise.")
       for b in (4, 3, 2)},
}

POLICIES = {
    "none": Term("Keep everything", "keeps every token",
                 "Never drops a token: the chat stops growing at the model's context.\n"
                 "Memory: grows with the chat.  Quality: exact."),
    "streaming": Term("Attention sinks + recent window (StreamingLLM)", "sinks + recent window",
                      "Keeps the first few tokens (attention sinks) and the most recent window; drops the middle.\n"
                      "Memory: fixed.  Speed: constant per token, and the chat can go on past the context.\n"
                      "Quality: the model forgets what was dropped."),
    "h2o": Term("Heavy hitters (H2O)", "heavy hitters",
                "Keeps the tokens that received the most attention so far, plus a recent window.\n"
                "Memory: fixed budget per layer.  Speed: a little slower (attention scores are collected).\n"
                "Quality: usually close to the full cache at half the budget."),
    "expected": Term("Expected attention", "expected attention",
                     "Keeps the tokens the coming words are expected to look at (predicted from the recent words' "
                     "attention queries), plus the first tokens and a recent window.\n"
                     "Memory: fixed budget per layer.  Speed: scoring a few ms every few tokens (shown under Token "
                     "timing).\nQuality: ranks above H2O and StreamingLLM on NVIDIA's kvpress benchmark."),
    "priority": Term("Priority pinning", "priority pinning",
                     "Keeps the system prompt and pinned messages; drops the lowest priority, then the oldest.\n"
                     "Memory: fixed budget.  Speed: unchanged.\n"
                     "Quality: what you pinned is never forgotten; the rest may be."),
}

OVERFLOWS = {
    "stop": Term("Stop the reply", "stops when full",
                 "When the context is full the reply stops and says so; nothing is dropped.\n"
                 "Start a new chat, shorten this one, or choose another option to go on."),
    "turns": Term("Drop the oldest turns", "drops the oldest turns",
                  "When the context is full, the oldest whole messages are dropped, as few as make room; the system "
                  "prompt, pinned messages and the latest message stay.\nMemory: stays at the context.  Quality: "
                  "the model forgets the oldest turns, never its instructions or what you pinned."),
    "truncate_middle": Term("Drop the middle", "drops the middle",
                            "When the context is full, the middle of the chat is dropped; the system prompt and "
                            "the first message stay.\nMemory: stays at the context.  Quality: the model forgets "
                            "the middle."),
    "rolling": Term("Drop the oldest (rolling window)", "drops the oldest",
                    "When the context is full, the oldest tokens are dropped, like a rolling window.\n"
                    "Memory: stays at the context.  Quality: the model forgets the start."),
    "policy": Term("Let the eviction policy decide", "policy decides",
                   "When the context is full, the eviction policy above chooses what to drop.\n"
                   "With 'Keep everything' this stops the reply."),
}

SPECULATION = {  # speculative decoding: who guesses the next tokens (SpecConfig.method)
    "off": Term("Off", "no speculation",
                "Every new token takes one pass of the model.\nMemory: nothing extra.  Speed: the usual.  "
                "Quality: exact."),
    "ngram": Term("Prompt lookup", "prompt lookup",
                  "Guesses the next tokens by finding the last few words earlier in the chat and copying what came "
                  "after them. The model checks all the guesses in one pass and keeps those it would have written "
                  "itself.\nMemory: nothing extra.  Speed: faster when the reply repeats the chat (quoting, editing, "
                  "code); it turns itself off for a reply where it does not pay.\nQuality: exact — the same tokens "
                  "as without it."),
    "draft": Term("Draft model", "draft model",
                  "A small model with the same tokenizer guesses the next tokens; the model checks them in one pass "
                  "and keeps those it would have written itself.\nMemory: the draft model's weights and its own "
                  "small cache.  Speed: faster when the draft model guesses well.\nQuality: exact — the same tokens "
                  "as without it."),
}

CONTROLS = {  # the other controls, by CacheConfig / SamplingConfig field name
    "mode": Term("Cache", "cache", "How the keys and values of past tokens are kept between steps."),
    "page_size": Term("Page size", "page",
                      "Tokens per page of the paged cache.\nMemory: small pages waste less on the last, "
                      "partly filled page; large pages need fewer lookups.\nSpeed: large pages are read in "
                      "fewer pieces.  Quality: unchanged."),
    "prefix_reuse": Term("Reuse the shared start of the chat", "prefix reuse",
                         "Keeps the cache between turns and computes only what changed (regenerate and edit "
                         "reuse what stayed the same).\nMemory: unchanged.  Speed: a much faster first token "
                         "in long chats.  Quality: exact."),
    "k_dtype": Term("Key precision", "keys", "Precision of the cached keys (the half attention compares with)."),
    "v_dtype": Term("Value precision", "values", "Precision of the cached values (the half attention mixes)."),
    "policy": Term("Eviction", "eviction", "Which tokens the cache drops to stay within a budget."),
    "overflow": Term("When the context is full", "when full", "What happens when the chat reaches the "
                     "model's context."),
    "temperature": Term("Temperature", "temperature",
                        "Randomness of the next word: 0 always picks the most likely one (greedy, repeatable); "
                        "higher is more varied.\nMemory and speed: unchanged."),
    "top_k": Term("Top-k", "top-k", "Samples only among the k most likely tokens (off: all of them)."),
    "top_p": Term("Top-p", "top-p", "Samples only among the most likely tokens that together reach this "
                  "probability (1: all)."),
    "min_p": Term("Min-p", "min-p", "Drops tokens less likely than this fraction of the most likely one (off: 0)."),
    "repetition_penalty": Term("Repetition penalty", "repetition penalty",
                               "Makes tokens already in the chat less likely (1: no penalty)."),
    "seed": Term("Seed", "seed", "Fixes the random numbers, so the same settings give the same reply "
                 "(random: a new seed each time)."),
    "max_new_tokens": Term("Max new tokens", "max new tokens",
                           "The longest reply, in tokens. A reply that would pass the model's context gets the "
                           "tokens that fit.\nMemory: the cache grows by this much per reply at most."),
    "speculation": Term("Guess tokens with", "speculative decoding",
                        "Speculative decoding: something cheap guesses the next few tokens, and the model checks "
                        "them all in one pass, so one pass can give several tokens."),
    "draft_path": Term("Draft model", "draft model",
                       "A smaller model with the same tokenizer as the chat's model (the same family), chosen as a "
                       "folder. A model with another tokenizer is refused, with the reason."),
    "draft_tokens": Term("Draft tokens", "draft tokens",
                         "How many tokens are guessed before each check. 0 adapts: more after guesses that were "
                         "all kept, fewer after a miss.\nSpeed: long guesses pay when most are kept.  "
                         "Quality: unchanged."),
    "spec_tint": Term("Tint accepted draft tokens", "tint",
                      "Shades the words of a reply that came from a guess the model kept (the rest it wrote "
                      "itself). Changes only how the reply looks."),
}

# Why a choice is greyed out: the tooltip's first line, in the controls' names. Keyed by ``engine.config.Need``
# (what a value needs from the rest of the settings), plus "pages" for the page size.
def off_too_long(tokens: int, context: int) -> str:
    """Why "cache off" cannot take the chat on screen (the engine's refusal, in the controls' words)."""
    return (f"This chat ({tokens:,} tokens) is as long as the model's context ({context:,}) or longer: with "
            f"\"{MODES['off'].name.split(' (')[0]}\" every step reads the whole chat, which the model cannot. Start a "
            "new chat to compare without a cache.")


NEEDS = {
    "cache": (f"Needs a cache: choose \"{MODES['contiguous'].name}\" or \"{MODES['paged'].name}\" under "
              f"{CONTROLS['mode'].name} (with \"{MODES['off'].name.split(' (')[0]}\" nothing is kept, so there is "
              "nothing to reuse or drop)."),
    "paged": f"Kept per page: needs the \"{MODES['paged'].name}\" cache (under {CONTROLS['mode'].name}).",
    "policy": (f"Needs an eviction policy to decide: choose one under {CONTROLS['policy'].name} (with "
               f"\"{POLICIES['none'].name}\" nothing is dropped)."),
    "pages": f"Only the \"{MODES['paged'].name}\" cache has pages (under {CONTROLS['mode'].name}).",
}

PARAMS = {  # policy parameters: plain names (the Params field's own help is the tooltip's first line)
    "sinks": ("First tokens kept (sinks)", "Memory: each kept token costs the same as any other."),
    "window": ("Recent tokens kept", "Memory: a larger window costs more; the model remembers more."),
    "budget": ("Tokens kept per layer", "Memory: the cache holds at most this many tokens per layer."),
    "recent": ("Recent tokens always kept", "Kept on top of the heavy hitters / priorities."),
    "default_priority": ("Priority of unpinned tokens", "0-99; pinned messages and the system prompt get 100."),
    "queries": ("Recent words that predict", "How many of the latest tokens' attention queries predict what the "
                "coming ones will look at.\nSpeed: more costs a little more at each eviction."),
    "per_head": ("Each KV head keeps its own", "Off: a layer's heads keep the same tokens (their scores summed).\n"
                 "Memory: the same either way: every head keeps as many tokens."),
}

STOP_REASONS = {  # stop_reason -> the mark under a reply ("" for a reply that simply ended)
    "eos": "ended: the model finished its reply (end of text)",
    "done": "",
    "stop_string": "ended: a stop string was written",
    "max_tokens": "stopped: max new tokens reached",
    "cancelled": "stopped by you",
    "context_full": "stopped: context full — start a new chat, shorten it, or choose an overflow policy",
    "budget_full": "stopped: the cache budget is full — raise the budget or choose an eviction policy",
    "error": "stopped by an error",
    "interrupted": "stopped: the app closed before this reply finished",
    "switched": "stopped: a message was sent in another chat",
}


def stop_mark(reason: str, detail: str = "") -> str:
    """The words under a reply for its stop reason (``detail`` overrides the generic words)."""
    if detail:
        return f"stopped: {detail}"
    if reason in STOP_REASONS:
        return STOP_REASONS[reason]
    return f"stopped: {reason.replace('_', ' ')}" if reason else ""


def name_of(table: dict[str, Term], key: str) -> str:
    """The plain name of ``key`` in ``table`` (the key itself for an id the table does not know)."""
    term = table.get(key)
    return term.name if term else key


def describe_cache(cfg: Any) -> str:
    """The cache settings in words, for the status bar: 'paged cache, 16-token pages · keys 8-bit ·
    heavy hitters, 256 per layer'. Only what differs from the defaults after the mode is named."""
    mode = MODES.get(cfg.mode)
    parts = [mode.short if mode else cfg.mode]
    if cfg.mode == "paged":
        parts[0] += f", {cfg.page_size}-token pages"
    if cfg.mode != "off":
        if cfg.k_dtype == cfg.v_dtype and cfg.k_dtype != "auto":
            parts.append(f"keys and values {KV_DTYPES[cfg.k_dtype].short}")
        else:
            parts += [f"{role} {KV_DTYPES[d].short}" for role, d in (("keys", cfg.k_dtype), ("values", cfg.v_dtype))
                      if d != "auto" and d in KV_DTYPES]
        if cfg.policy != "none":
            policy = POLICIES.get(cfg.policy)
            text = policy.short if policy else cfg.policy
            budget = (cfg.policy_params or {}).get("budget")
            parts.append(f"{text}, {budget} per layer" if budget else text)
    return " · ".join(parts)


def describe_spec(cfg: Any) -> str:
    """Speculative decoding's setting in words: 'Prompt lookup, the draft length adapts' or 'Draft model
    stories260K, 4 draft tokens per check' or 'Off: one token per pass of the model'."""
    term = SPECULATION.get(cfg.method)
    name = term.name if term else cfg.method
    if cfg.method == "off":
        return f"{name}: one token per pass of the model"
    if cfg.method == "draft":
        name += " " + (cfg.draft_path.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1] or cfg.draft_path)
    return name + (f", {cfg.draft_tokens} draft tokens per check" if cfg.draft_tokens else ", the draft length adapts")


def describe_switches(old: Any, new: Any) -> list[str]:
    """What a cache change made mid-reply changed besides the mode (the reply's footer names the mode's own
    switch), in the controls' words: ['keys full precision → 8-bit', 'policy keeps every token → heavy
    hitters']."""
    out = []
    for role, field in (("keys", "k_dtype"), ("values", "v_dtype")):
        a, b = getattr(old, field), getattr(new, field)
        if a != b:
            out.append(f"{role} {KV_DTYPES[a].short if a in KV_DTYPES else a} → "
                       f"{KV_DTYPES[b].short if b in KV_DTYPES else b}")
    budgets = [(c.policy_params or {}).get("budget") for c in (old, new)]
    if old.policy != new.policy or budgets[0] != budgets[1]:
        names = [(POLICIES[c.policy].short if c.policy in POLICIES else c.policy) + (f" ({b} per layer)" if b else "")
                 for c, b in zip((old, new), budgets)]
        out.append(f"policy {names[0]} → {names[1]}")
    if old.page_size != new.page_size and old.mode == new.mode == "paged":
        out.append(f"pages of {old.page_size} → {new.page_size} tokens")
    return out
