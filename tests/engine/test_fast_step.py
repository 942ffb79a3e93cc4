"""The compiled decode step (engine.model.fast_step): exact against HF, built in a child process while eager answers,
kept only where it pays, refused where it cannot run, and a failed compiled call costs nothing but speed.

Each model shape here is built once (~20-60 s of CPU on the project's 2-core machine, then kept in the compile
cache), so the tests share module-scoped models."""

from __future__ import annotations

import time

import pytest
import torch

from engine.config import CacheConfig, SamplingConfig
from engine.model.fast_step import EARLY_STEPS, TRIAL_STEPS, FastStep, machine_refusal
from engine.core.session import ChatSession

NO_COMPILE = machine_refusal(torch.device("cpu"))
needs_compile = pytest.mark.skipif(bool(NO_COMPILE), reason=f"cannot compile here: {NO_COMPILE}")


@pytest.fixture(scope="module")
def lm(stories_path):
    from engine.model.loader import load_model

    m = load_model(str(stories_path))
    m.runner.fast = FastStep(m, mode="on")
    return m


def _hf_greedy(lm, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _reply(lm, ids, n, cache=None, each=None):
    """Greedy reply of ``n`` tokens; (token ids, path of each token's forward)."""
    s = ChatSession(lm, cache or CacheConfig())
    try:
        s.start_ids(ids, SamplingConfig(max_new_tokens=n, ignore_eos=True, temperature=0.0))
        paths = []
        while True:
            r = s.step()
            if r.event is not None:
                paths.append(r.event.path)
                if each is not None:
                    each(s, len(paths))
            if r.done:
                return s.seq[len(ids):], paths
    finally:
        s.close()


def _prompt(lm) -> list[int]:
    return lm.tokenizer("Once upon a time, there was a little girl")["input_ids"]


@needs_compile
def test_replies_never_wait_for_the_build_and_switch_to_compiled_between_two_tokens(lm, tmp_path, monkeypatch):
    """The step is built in a child process (a cold cache here): replies run eager from the first token on,
    with no pause while it builds, and the reply running when the build ends takes the compiled step from its
    next token on — all of it HF's greedy ids. Then the package is in the cache: a new model loads it at once."""
    monkeypatch.setenv("KVSCOPE_COMPILE_CACHE", str(tmp_path))
    assert lm.fast.state == "idle"
    lm.fast.start()
    assert lm.fast.state == "compiling"
    ids, n = _prompt(lm), 300  # HF-exact this far (a near-tie at ~330 tokens splits float32 paths)
    want = _hf_greedy(lm, ids, n)
    stamps, switched = [], None
    for _ in range(400):  # replies until one sees the build end (stories: ~1 s a reply, the build ~20-60 s)
        got, paths = _reply(lm, ids, n, each=lambda s, i: stamps.append(time.perf_counter()))
        assert got == want
        if "compiled" in paths:
            switched = paths
            break
    assert switched is not None, lm.fast.describe()
    k = switched.index("compiled")
    assert k >= 1 and switched == ["eager"] * k + ["compiled"] * (n - k)  # prefill eager; then one switch
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert max(gaps) < 2.0, max(gaps)  # no token waited for the compile (eager ~3 ms a token)
    assert lm.fast.state == "on" and lm.fast.compile_s > 0
    assert len(list(tmp_path.glob("step-*.pt2"))) == 1

    from engine.model.loader import load_model

    again = load_model(str(lm.path))
    again.runner.fast = FastStep(again, mode="on")
    again.fast.start()  # from the cache: opened in the background, no build
    assert again.fast.wait(60) and again.fast.state == "on" and again.fast.compile_s == 0
    got, paths = _reply(again, ids, 40)
    assert got == want[:40] and paths[1:] == ["compiled"] * 39


@needs_compile
def test_compiled_step_gives_hf_greedy_ids_for_300_tokens(lm):
    lm.fast.start()
    assert lm.fast.wait(300) and lm.fast.state == "on"
    ids = _prompt(lm)
    got, paths = _reply(lm, ids, 300)
    assert paths[0] == "eager"  # the prompt's prefill
    assert paths[1:] == ["compiled"] * 299
    assert got == _hf_greedy(lm, ids, 300)


@needs_compile
def test_page_growth_and_a_page_size_switch_mid_reply_stay_compiled_and_exact(lm):
    """The arena's tensors grow (new sizes) and a page-size switch makes another arena: one graph serves them
    all (its lengths are dynamic), so no call recompiles or falls back."""
    lm.fast.start()
    assert lm.fast.wait(300)
    ids = _prompt(lm)

    def switch(s, k):
        if k == 100:
            s.apply(CacheConfig(page_size=8))

    got, paths = _reply(lm, ids, 200, cache=CacheConfig(page_size=1), each=switch)
    assert lm.fast.state == "on", lm.fast.describe()
    assert paths.count("compiled") == 199
    assert got == _hf_greedy(lm, ids, 200)


@needs_compile
@pytest.mark.parametrize("cache, why", [
    (CacheConfig(k_dtype="int8", v_dtype="int8"), "int8"),
    (CacheConfig(mode="contiguous"), "paged"),
    (CacheConfig(policy="h2o", policy_params={"budget": 64, "recent": 16}), "scores"),
])
def test_chats_the_step_cannot_run_stay_eager(lm, cache, why):
    lm.fast.start()
    assert lm.fast.wait(300)
    s = ChatSession(lm, cache)
    try:
        assert why in lm.fast.refusal(s.store, s.policy is not None and s.policy.needs_scores)
    finally:
        s.close()
    _, paths = _reply(lm, _prompt(lm), 20, cache=cache)
    assert set(paths) == {"eager"}
    assert lm.fast.state == "on"  # other chats keep it


@needs_compile
@pytest.mark.parametrize("cache", [
    CacheConfig(page_size=4, policy="streaming", policy_params={"sinks": 4, "window": 40}),
    CacheConfig(page_size=8, policy="priority", policy_params={"budget": 48, "recent": 8}),
])
def test_policies_that_read_no_scores_run_compiled_and_give_what_eager_gives(lm, cache):
    """Evicting policies rewrite the pages (StreamingLLM re-rotates kept keys), so the step reads scattered
    pages through its slot list; the tokens must be eager's, evictions and all."""
    lm.fast.start()
    assert lm.fast.wait(300)
    ids = _prompt(lm)
    got, paths = _reply(lm, ids, 150, cache=cache)
    assert paths.count("compiled") == 149
    lm.fast.set_mode("off")
    try:
        want, eager = _reply(lm, ids, 150, cache=cache)
    finally:
        lm.fast.set_mode("on")
    assert set(eager) == {"eager"}
    assert got == want


@needs_compile
def test_a_failed_compiled_call_falls_back_to_eager_exactly(lm, monkeypatch):
    lm.fast.start()
    assert lm.fast.wait(300)
    ids = _prompt(lm)
    want = _hf_greedy(lm, ids, 40)
    real = lm.fast._fn
    calls = []

    def boom(*args):
        calls.append(1)
        if len(calls) == 10:
            raise RuntimeError("injected failure")
        return real(*args)

    monkeypatch.setattr(lm.fast, "_fn", boom)
    try:
        got, paths = _reply(lm, ids, 40)
        assert got == want  # the failed step's token came from the eager forward, nothing half written
        assert paths[1:10] == ["compiled"] * 9 and set(paths[10:]) == {"eager"}
        assert lm.fast.state == "failed" and "injected failure" in lm.fast.reason
    finally:
        monkeypatch.setattr(lm.fast, "_fn", real)
        lm.fast.state, lm.fast.reason = "on", ""


@needs_compile
def test_auto_mode_measures_both_paths_then_keeps_one(lm):
    lm.fast.start()
    assert lm.fast.wait(300)
    lm.fast.set_mode("auto")
    try:
        assert lm.fast.state == "trial"
        got, paths = _reply(lm, _prompt(lm), TRIAL_STEPS + 20)
        n = lm.fast.trial_steps  # TRIAL_STEPS, or from EARLY_STEPS on where compiled is plainly faster
        assert EARLY_STEPS <= n <= TRIAL_STEPS, n
        trial = paths[1:n + 1]
        assert abs(trial.count("eager") - n / 4) < 1  # one step in four runs eager while measuring
        assert lm.fast.state in ("on", "slower"), lm.fast.describe()
        assert "compiled" in lm.fast.reason and "eager" in lm.fast.reason and "ms" in lm.fast.reason
        kept = "compiled" if lm.fast.state == "on" else "eager"
        assert set(paths[n + 1:]) == {kept}
        assert got == _hf_greedy(lm, _prompt(lm), TRIAL_STEPS + 20)
    finally:
        lm.fast.set_mode("on")


def test_off_never_compiles(stories):
    fast = FastStep(stories, mode="off")
    assert fast.state == "off" and "settings" in fast.reason
    s = ChatSession(stories, CacheConfig())
    try:
        assert fast.choose(s.store) == "eager"
    finally:
        s.close()
    fast.start()
    assert fast._proc is None and fast.state == "off"
    with pytest.raises(ValueError, match="fast step"):
        fast.set_mode("fastest")


@needs_compile
def test_a_random_weight_qwen2_shape_agrees_with_eager_logits():
    """Another architecture (Qwen2: biased q/k/v, tied embeddings): the compiled step's logits against the
    eager step's at each of 40 tokens, teacher-forced on the same ids; the largest difference is reported."""
    from engine.model.shapes import build_shape

    lm = build_shape("tiny-qwen2")
    lm.runner.fast = FastStep(lm, mode="on")
    lm.fast.start()
    assert lm.fast.wait(300) and lm.fast.state == "on", lm.fast.describe()
    ids = torch.randint(3, lm.info.vocab_size, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    runs = {}
    for mode in ("off", "on"):
        lm.fast.set_mode(mode)
        s = ChatSession(lm, CacheConfig(page_size=4))
        s.start_ids(ids, SamplingConfig(max_new_tokens=40, ignore_eos=True, temperature=0.0))
        logits, paths = [], []
        real = s.finish

        def spy(out, *a, real=real):
            logits.append(out.logits.clone())
            paths.append(out.path)
            return real(out, *a)

        s.finish = spy
        while not s.step().done:
            pass
        runs[mode] = (s.seq[len(ids):], torch.stack(logits), paths)
        s.close()
    assert set(runs["on"][2][1:]) == {"compiled"} and set(runs["off"][2]) == {"eager"}
    diff = (runs["on"][1] - runs["off"][1]).abs().max().item()
    print(f"tiny-qwen2: largest logit difference compiled vs eager over 40 tokens: {diff:.2e}")
    assert diff < 1e-4
    assert runs["on"][0] == runs["off"][0]


@pytest.mark.parametrize("change, why", [
    (dict(layer_kinds=("full", "sliding")), "sliding"),
    (dict(quantization="nf4"), "no block plan"),  # (bitsandbytes modules: test_nf4_blocks)
    (dict(attn_impl="eager"), "eager attention"),
])
def test_models_the_step_cannot_serve_say_why_and_never_compile(stories, change, why):
    from dataclasses import replace

    lm = replace(stories, info=replace(stories.info, **change), model_runner=None)
    fast = FastStep(lm, mode="auto")
    assert fast.state == "off" and why in fast.reason
    fast.start()
    assert fast._proc is None and fast.state == "off"


def test_an_unknown_setting_in_the_environment_is_warned_about(monkeypatch, caplog):
    from engine.model.fast_step import env_mode

    monkeypatch.setenv("KVSCOPE_FAST_STEP", "of")
    with caplog.at_level("WARNING", logger="kvscope"):
        assert env_mode() == "auto"
    assert "KVSCOPE_FAST_STEP='of' is not one of auto, on, off" in caplog.text
    monkeypatch.setenv("KVSCOPE_FAST_STEP", " OFF ")
    assert env_mode() == "off"


def test_a_failed_build_says_why_and_replies_stay_eager(stories, tmp_path, monkeypatch):
    """The child process fails (here: a stand-in that prints a reason and exits 1): the step says why, the
    reply ran eager throughout and nothing is left half-written in the cache folder."""
    import sys

    from engine.model import aot_step

    monkeypatch.setenv("KVSCOPE_COMPILE_CACHE", str(tmp_path))
    monkeypatch.setattr(aot_step, "child_command",
                        lambda build: [sys.executable, "-c", "print('RuntimeError: no C++ compiler here'); exit(1)"])
    from dataclasses import replace

    lm = replace(stories, model_runner=None, arenas=None)
    lm.runner.fast = FastStep(lm, mode="on")
    lm.fast.start()
    _, paths = _reply(lm, _prompt(lm), 20)
    assert lm.fast.wait(60) and lm.fast.state == "failed"
    assert "no C++ compiler here" in lm.fast.reason
    assert set(paths) == {"eager"} and not list(tmp_path.glob("*.pt2"))


def test_a_hung_build_is_stopped_and_said(stories, tmp_path, monkeypatch):
    """A compiler that hangs (here: a child that sleeps) is stopped after the build timeout; the step says so."""
    import sys
    import time as _time

    from engine.model import aot_step, fast_step

    monkeypatch.setenv("KVSCOPE_COMPILE_CACHE", str(tmp_path))
    monkeypatch.setattr(fast_step, "BUILD_TIMEOUT_S", 1.0)
    monkeypatch.setattr(aot_step, "child_command", lambda build: [sys.executable, "-c", "import time; time.sleep(60)"])
    from dataclasses import replace

    lm = replace(stories, model_runner=None, arenas=None)
    lm.runner.fast = FastStep(lm, mode="on")
    t0 = _time.perf_counter()
    lm.fast.start()
    assert lm.fast.wait(30) and lm.fast.state == "failed"
    assert "took over 1 s and was stopped" in lm.fast.reason and _time.perf_counter() - t0 < 30


def test_inductor_keeps_its_cache_in_the_users_cache_folder(stories_path, tmp_path):
    """torch fixes TORCHINDUCTOR_CACHE_DIR to /tmp the first time anything asks for its cache folder (loading a
    model does): the engine sets it to the user's cache folder first, unless the user set it."""
    import os
    import subprocess
    import sys

    code = ("import os, engine\nfrom engine.model.loader import load_model\nload_model(%r)\n"
            "print(os.environ['TORCHINDUCTOR_CACHE_DIR'])" % str(stories_path))
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, XDG_CACHE_HOME=str(tmp_path)),
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == str(tmp_path / "kvscope" / "torch-compile")
    mine = subprocess.run([sys.executable, "-c", code], env=dict(env, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "x")),
                          capture_output=True, text=True, timeout=300)
    assert mine.stdout.strip().splitlines()[-1] == str(tmp_path / "x")


@needs_compile
def test_a_reply_under_a_grammar_on_the_compiled_step_is_the_eager_ones(lm, stories):
    """Structured output on the compiled step: its logits go through the same sampler mask, so the reply is the
    eager one's, token for token, and parses."""
    import json

    from engine.core.grammar import compile_json_schema

    lm.fast.start()
    assert lm.fast.wait(300) and lm.fast.state == "on"
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "pet": {"enum": ["cat", "dog"]}},
              "required": ["name", "pet"], "additionalProperties": False}
    chat = [{"role": "user", "content": "Tell me about Lily."}]
    out = {}
    for name, model in (("compiled", lm), ("eager", stories)):
        s = ChatSession(model, CacheConfig())
        g = compile_json_schema(model.tokenizer, model.info.vocab_size, model.stop_ids, schema, "test")
        s.start(chat, SamplingConfig(max_new_tokens=80, grammar=g))
        paths = []
        while not (r := s.step()).done:
            paths.append(r.event.path if r.event is not None else "")
        out[name] = (r.text, list(s.generated_ids), paths)
        s.close()
    assert "compiled" in out["compiled"][2] and "compiled" not in out["eager"][2]
    assert out["compiled"][:2] == out["eager"][:2]
    assert json.loads(out["compiled"][0])["pet"] in ("cat", "dog")
