"""Every file a CLI verb reads or writes, and the leftover flags of issue #29 item 4: one line, exit 2.

``quality --text /dev/zero`` grew to 23.9 GB before the kernel killed it; a FIFO given to ``--messages`` or
``--text`` blocked forever; ``bench --json /dev/full`` failed only after the whole run; ``--kv-disk-budget
inf`` was an internal OverflowError; ``quality --page-size 0`` ran (generate refused it); ``generate --prompt
''`` completed the BOS token; ``--quantize int8`` on a CPU printed 175 warning lines. Each run here is a real
``python -m engine`` with a timeout, so a regression that blocks fails the test instead of hanging the suite.
The model named is a folder that does not exist where the refusal must come before loading: a refusal about
the file or flag (not "model folder not found") shows it was checked first.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from engine.tools.cli_flags import build_parser
from engine.inputs import DEFAULT_LIMIT
from engine.model.log_once import OncePerMessage

HANG_GUARD_S = 120  # a refusal takes well under a second; this only stops a blocked read from hanging CI


def _engine(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *argv], capture_output=True, text=True,
                          timeout=HANG_GUARD_S, stdin=subprocess.DEVNULL)


def _refused(p: subprocess.CompletedProcess) -> str:
    """The one stderr line of a run that exited 2 with nothing on stdout."""
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert p.stdout == "" and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    return p.stderr.rstrip("\n")


def _fifo(d):
    os.mkfifo(d / "fifo")  # nobody ever writes to it: reading it would block forever
    return d / "fifo"


def _zero_link(d):
    os.symlink("/dev/zero", d / "link.json")
    return d / "link.json"


def _directory(d):
    (d / "folder").mkdir()
    return d / "folder"


def _big(d):
    with open(d / "big.json", "wb") as f:
        f.truncate(DEFAULT_LIMIT + (1 << 20))  # 17 MiB, sparse: no disk written
    return d / "big.json"


INPUTS = {  # name -> (make the path, what the line says about it)
    "fifo": (_fifo, "is a pipe (FIFO), not a file"),
    "dev_zero": (lambda d: "/dev/zero", "is a device, not a file"),
    "link_to_dev_zero": (_zero_link, "is a device, not a file"),
    "directory": (_directory, "is a directory, not a file"),
    "17_mib": (_big, "is larger than 16 MiB (17 MiB)"),
}
VERBS = {  # verb -> (argv with {path} and {out}, how the line names the file, its hint)
    "generate --messages": (["generate", "--model", "{missing}", "--messages", "{path}"], "messages file",
                            "give a JSON list of {role, content}"),
    "quality --text": (["quality", "--model", "{missing}", "--text", "{path}", "--json", "{out}"], "--text file",
                       "give a UTF-8 text file"),
}


@pytest.mark.parametrize("verb", sorted(VERBS))
@pytest.mark.parametrize("case", sorted(INPUTS))
def test_a_file_argument_that_is_not_a_small_regular_file_is_one_line(tmp_path, verb, case):
    make, words = INPUTS[case]
    path = str(make(tmp_path))
    argv, what, hint = VERBS[verb]
    fill = {"path": path, "out": str(tmp_path / "out.json"), "missing": str(tmp_path / "no-such-model")}
    line = _refused(_engine(*[a.format(**fill) for a in argv]))
    assert line == f"error: {what} {path} {words}: {hint}"
    assert not (tmp_path / "out.json").exists()


def test_a_file_just_under_the_cap_is_read(tmp_path):
    """The cap refuses only what is past it: 16 MiB of text is read and decoded (here: found not UTF-8, a
    complaint that needs every byte read)."""
    f = tmp_path / "t.txt"
    f.write_bytes(b"a" * (DEFAULT_LIMIT - 1) + b"\xff")
    line = _refused(_engine("quality", "--model", str(tmp_path / "no-such-model"), "--text", str(f),
                            "--json", str(tmp_path / "out.json")))
    assert line == f"error: --text file {f} is not UTF-8 text (byte 0xff at position {DEFAULT_LIMIT - 1}): " \
                   "save it as UTF-8"


def _full_link(d):
    os.symlink("/dev/full", d / "out.json")
    return d / "out.json"


OUTPUTS = {  # opens fine; /dev/full fails the write with ENOSPC, a FIFO with no reader blocks the open
    "dev_full": (lambda d: "/dev/full", "is a device, not a file"),
    "dev_null": (lambda d: "/dev/null", "is a device, not a file"),
    "link_to_dev_full": (_full_link, "is a device, not a file"),
    "fifo": (_fifo, "is a pipe (FIFO), not a file"),
}


@pytest.mark.parametrize("command", ["bench", "quality"])
@pytest.mark.parametrize("case", sorted(OUTPUTS))
def test_a_json_result_that_cannot_be_a_file_is_refused_before_the_run(tmp_path, command, case):
    make, words = OUTPUTS[case]
    target = str(make(tmp_path))
    line = _refused(_engine(command, "--model", str(tmp_path / "no-such-model"), "--json", target))
    assert line == f"error: --json {target} {words}: give a file name"


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0"])
@pytest.mark.parametrize("verb", ["generate", "serve"])
def test_kv_disk_budget_must_be_a_finite_size(tmp_path, verb, value):
    argv = [verb, "--model", str(tmp_path / "no-such-model"), "--kv-disk-budget", value]
    line = _refused(_engine(*argv, *(["--prompt", "hi"] if verb == "generate" else [])))
    assert line == f"error: --kv-disk-budget {float(value)}: give more than 0 GiB (a finite number, e.g. 4)"


def test_kv_disk_budget_takes_a_fraction_of_a_gib():
    from engine.tools.arguments import check_disk_budget

    a = build_parser().parse_args(["generate", "--model", "demo", "--prompt", "hi", "--kv-disk-budget", "0.25"])
    assert a.kv_disk_budget == 0.25
    check_disk_budget(a.kv_disk_budget)  # no error


@pytest.mark.parametrize("verb", ["generate", "quality"])
def test_page_size_0_is_the_same_line_for_generate_and_quality(tmp_path, verb):
    argv = [verb, "--model", str(tmp_path / "no-such-model"), "--page-size", "0"]
    extra = ["--prompt", "hi"] if verb == "generate" else ["--json", str(tmp_path / "q.json")]
    assert _refused(_engine(*argv, *extra)) == "error: page size: 0 is outside 1..256"


def test_quality_page_size_applies_to_every_default_row():
    """Without a setting named on the command line --page-size was ignored: every default row used 16."""
    from engine.tools.quality import default_settings

    assert {s.page_size for s in default_settings(300, 512, page_size=8)} == {8}


def test_an_empty_prompt_is_refused_as_the_api_refuses_it(tmp_path):
    line = _refused(_engine("generate", "--model", str(tmp_path / "no-such-model"), "--prompt", ""))
    assert line == "error: prompt: empty (nothing to complete)"


def test_int8_on_a_cpu_generates_and_says_its_float16_cast_once(stories_path):
    pytest.importorskip("bitsandbytes")
    p = _engine("generate", "--model", str(stories_path), "--prompt", "Once", "--max-new-tokens", "3",
                "--ignore-eos", "--quantize", "int8", "--device", "cpu", "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    assert len(json.loads(p.stdout)["token_ids"]) == 3
    said = [line for line in p.stderr.splitlines() if not line.startswith("note: ")]  # the memory verdict
    assert said in ([], ["MatMul8bitLt: inputs will be cast from torch.float32 to float16 "
                         "during quantization"])  # 175 lines before: one per 8-bit matmul


def test_once_per_message_passes_each_distinct_message_once():
    f = OncePerMessage()

    def rec(msg, *args):
        return logging.LogRecord("bitsandbytes", logging.WARNING, __file__, 1, msg, args, None)

    seen = [f.filter(rec("cast from %s", "float32")), f.filter(rec("cast from %s", "float32")),
            f.filter(rec("cast from %s", "bfloat16")), f.filter(rec("cast from float32"))]
    assert seen == [True, False, True, False]
