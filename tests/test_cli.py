"""`tinyllm generate` as a user runs it: streamed answer and summary, or one-line errors."""

import io
import re
import subprocess
import sys

import pytest
import torch

from tinyllm.model.precision import resolve_dtype

pytestmark = pytest.mark.slow

# The activations' dtype `auto` picks on this machine: bf16 with AMX, else fp32.
AUTO_DTYPE = str(resolve_dtype("auto", torch.device("cpu"))[0]).removeprefix("torch.")


def _tinyllm(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tinyllm.entrypoints.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        input=stdin,
    )


def test_generate_answers_and_summarises():
    """README's first command, with the default sampling settings: a complete answer."""
    r = _tinyllm("generate", "What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "The capital of France is Paris."
    summary = r.stderr.strip().splitlines()[-1]
    assert "generated" in summary and "tok/s" in summary and "finish: stop" in summary
    # Loading says what it loaded, how big, where and how long it took.
    assert re.search(
        r"INFO tinyllm: loaded SmolLM2-135M-Instruct\.Q4_1: 134\.5M parameters, \d+ MB "
        rf"resident \(int4 weights, {AUTO_DTYPE} activations\) on cpu, in \d+\.\d s",
        r.stderr,
    ), r.stderr


def test_chat_defaults_give_a_complete_answer(default_llm):
    """No SamplingParams: the defaults (greedy, up to 512 tokens) let README's question finish,
    where SamplingParams() (temperature 1, 16 tokens) cut it off."""
    [out] = default_llm.chat([{"role": "user", "content": "Name three colours."}], use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop"
    assert all(colour in out.text for colour in ("Red", "Blue", "Green")), out.text


def test_chat_keeps_the_conversation(default_llm, monkeypatch, capsys):
    """The REPL sends the whole conversation, earlier answers included, on every turn."""
    from tinyllm.entrypoints import cli

    seen = []
    render = default_llm.tokenizer.apply_chat_template
    monkeypatch.setattr(
        default_llm.tokenizer,
        "apply_chat_template",
        lambda msgs, *a, **kw: seen.append([dict(m) for m in msgs]) or render(msgs),
    )
    monkeypatch.setattr(cli, "build_llm", lambda args: default_llm)
    monkeypatch.setattr("sys.stdin", io.StringIO("My name is Ada.\nWhat is my name?\n\n"))
    assert cli.main(["chat", "--max-tokens", "8"]) == 0
    first_reply = capsys.readouterr().out.split("> ")[1].strip()
    assert [m["role"] for m in seen[1]] == ["user", "assistant", "user"]
    assert seen[1][0]["content"] == "My name is Ada."
    assert seen[1][1]["content"].strip() == first_reply and first_reply
    assert seen[1][2]["content"] == "What is my name?"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/no/such/model.gguf"], "no such model file or directory"),
        (["--max-model-len", "8"], "context is 8 tokens"),
    ],
)
def test_bad_input_is_one_line_without_traceback(args, message):
    r = _tinyllm("generate", "What is the capital of France? " * 3, *args)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in r.stderr
    assert lines[-1].startswith("tinyllm: error:") and message in lines[-1], r.stderr


def test_corrupt_gguf_is_one_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    r = _tinyllm("generate", "hi", "--model", str(bad))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "broken.gguf" in r.stderr.strip().splitlines()[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
@pytest.mark.parametrize(
    ("device", "message"),
    [("cuda", "device 'cuda': this torch is a CPU-only build"), ("gpu", "unknown device 'gpu'")],
)
def test_an_unusable_device_is_one_line_before_loading(device, message):
    r = _tinyllm("generate", "Hi", "--device", device)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tinyllm: error: {message}") and "use cpu" in last, r.stderr
