"""``engine.model.heap``: a CPU model's process keeps freed activations for the next layer instead of faulting
them in again (glibc), and leaves the heap alone where the user chose its rules."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from engine.model import heap

linux_glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                                 reason="glibc's mallopt only")

# a prompt's layers in small (the SmolLM2 shape's activations at 1,024 tokens, random weights, torch's ops); prints
# the page faults of 30 layers after 4 to warm up
LAYERS = """
import resource, sys, torch
from engine.model import heap
torch.set_num_threads(1)
if sys.argv[1] == "kept":
    heap.keep_freed_memory()
wgu, wd, wqkv, wo = (torch.randn(576, 3072) * 0.02, torch.randn(1536, 576) * 0.02, torch.randn(576, 960) * 0.02,
                     torch.randn(576, 576) * 0.02)
def layer(x):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)  # [n, 576]
    x = x + (h @ wqkv)[:, :576] @ wo
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    gu = h @ wgu  # [n, 3072]
    return x + (torch.nn.functional.silu(gu[:, :1536]) * gu[:, 1536:]) @ wd
x = torch.randn(1024, 576)
for _ in range(4):
    x = layer(x)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):
    x = layer(x)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _clean_env(**env) -> dict[str, str]:
    """This process's environment without the heap's variables, plus ``env``."""
    keep = {k: v for k, v in os.environ.items() if k not in heap.USER_VARS and k != "KVSCOPE_HEAP"}
    return {**keep, **env}


def _faults(mode: str, **env) -> int:
    out = subprocess.run([sys.executable, "-c", LAYERS, mode], capture_output=True, text=True, timeout=120,
                         env=_clean_env(**env), check=True)
    return int(out.stdout.split()[-1])


PAGES = 30 * 40 * 256  # what the 30 layers allocate: ~40 MB a layer, in 4 KB pages


@linux_glibc
def test_freed_activations_are_reused_not_faulted_in_again():
    # kept: the first layers' blocks reused (1,152-1,536 faults here). glibc's own rules move with the process's
    # history (0 to 21,024 faults for this loop; 194,000 in a real 1,024-token prefill): the user's rules below
    # return every block at once, as glibc does at its worst
    kept = _faults("kept")
    assert kept < PAGES // 50, kept
    returned = _faults("kept", MALLOC_MMAP_THRESHOLD_="1048576", MALLOC_TRIM_THRESHOLD_="1048576")
    assert returned > PAGES // 4, returned  # the user's rules stand: heap.keep_freed_memory set nothing


@linux_glibc
def test_the_off_switch_and_the_users_variables_are_said(monkeypatch):
    monkeypatch.setenv("KVSCOPE_HEAP", "default")
    assert heap._apply() == "glibc's own rules (KVSCOPE_HEAP=default)"
    monkeypatch.setenv("KVSCOPE_HEAP", "Off")
    assert heap._apply() == "glibc's own rules (KVSCOPE_HEAP=off)"
    monkeypatch.delenv("KVSCOPE_HEAP")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    assert heap._apply() == "the rules the user set (MALLOC_TRIM_THRESHOLD_)"


@linux_glibc
def test_an_unknown_switch_value_is_said_once_in_the_log(monkeypatch, caplog):
    monkeypatch.setenv("KVSCOPE_HEAP", "sometimes")
    monkeypatch.setenv("MALLOC_TOP_PAD_", "0")  # the user's rules: nothing is set in this process
    with caplog.at_level("WARNING", logger=heap.__name__):
        assert heap._apply() == "the rules the user set (MALLOC_TOP_PAD_)"
    assert [r.getMessage() for r in caplog.records] == [
        "KVSCOPE_HEAP=sometimes is not one of keep, default, off: the heap's rules are set (keep)"]


@linux_glibc
def test_a_cpu_model_sets_the_rules_when_it_loads():
    code = ("from engine.model import heap; from engine.model.loader import load_model; "
            "load_model('resources/models/stories260K'); print(heap._state.get('why'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=_clean_env(), check=True)
    assert out.stdout.strip().splitlines()[-1].startswith("kept"), out.stdout + out.stderr
