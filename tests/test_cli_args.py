"""The command line before any model loads: flags made from the option fields, help for every
option, the model given positionally, usage errors named as typed (status 2, no traceback), and
the prefill progress bar of `stream`."""

import argparse
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tinyllm.engine.config import EngineConfig
from tinyllm.engine.engine import LLMEngine
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.entrypoints import cli
from tinyllm.entrypoints.args import engine_options
from tinyllm.entrypoints.llm_options import OPTION_CLASSES
from tinyllm.host.options import option_fields


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]


def test_every_option_of_every_command_has_help_and_its_default():
    parsers = list(cli.iter_parsers(cli.build_parser()))
    names = {p.prog for p in parsers}
    assert {"tinyllm generate", "tinyllm serve", "tinyllm bench offline-small"} <= names
    for parser in parsers:
        text = parser.format_help()
        assert "(default: None)" not in text, parser.prog  # None must be said in words
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):  # each command has a help line
                assert all(c.help for c in action._choices_actions), parser.prog
            else:
                assert action.help, f"{parser.prog} {action.option_strings or action.dest}"
        for action in _options(parser):
            if action.default is not None:
                formatted = parser._get_formatter()._get_help_string(action)
                assert "default" in formatted, f"{parser.prog} {action.option_strings}"


def test_bench_lists_its_workloads():
    text = cli.build_parser().format_help()
    assert all(w in text for w in ("offline-small", "shared-prefix", "single", "serve"))


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (
            ["generate", "Hi", "--temperature", "-1"],
            "argument --temperature: must be a number in [0, 100]",
        ),
        (["generate", "Hi", "--max-tokens", "0"], "argument --max-tokens: must be an integer >= 1"),
        (["generate", "Hi", "--top-p", "2"], "argument --top-p: must be a number in (0, 1], got 2"),
        (["generate", "Hi", "--top-k", "many"], "argument --top-k: 'many' is not an integer"),
        (["chat", "--temperature", "hot"], "argument --temperature: 'hot' is not a number"),
        (["generate", "Hi", "--threads", "0"], "argument --threads: must be >= 1, got 0"),
        (["serve", "--port", "70000"], "argument --port: '70000' is not a port number"),
        (["serve", "--block-size", "0"], "argument --block-size: must be >= 1, got 0"),
        (["generate", "Hi", "--generation-config", "hf"], "argument --generation-config"),
        (
            ["serve", "--speculative-config", '{"method": "eagle"}'],
            "argument --speculative-config: speculative_config method='eagle'",
        ),
    ],
)
def test_bad_flags_are_usage_errors_before_loading(monkeypatch, capsys, args, named):
    monkeypatch.setattr(cli, "build_llm", lambda args: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"tinyllm {args[0]}: error: {named}"), err


class _Bar:
    """Stands in for tqdm: records each bar and how far it got."""

    made: list["_Bar"] = []

    def __init__(self, total: int, **kwargs) -> None:
        self.total, self.n, self.updates, self.closed = total, 0, [], False
        _Bar.made.append(self)

    def update(self, n: int) -> None:
        self.n += n
        self.updates.append(self.n)

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(("prompt_len", "bars"), [(40, 1), (16, 0)])
def test_a_long_prompt_shows_prefill_progress(tiny, monkeypatch, capsys, prompt_len, bars):
    """At 4 tokens a step, 40 prompt tokens take 10 steps: a bar that counts them; 16 tokens
    (4 steps) are quick enough to need none."""
    model, tokenizer = tiny
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=16, max_num_batched_tokens=4))
    monkeypatch.setattr(cli, "tqdm", _Bar)
    _Bar.made = []
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    cli.stream(SimpleNamespace(engine=engine), [5] * prompt_len, params)
    assert len(_Bar.made) == bars
    if bars:
        [bar] = _Bar.made
        assert bar.total == prompt_len and bar.closed
        assert bar.updates[:3] == [4, 8, 12] and bar.updates[-1] == prompt_len


@pytest.mark.parametrize(
    "command", [["generate", "Hi"], ["chat"], ["serve"], ["bench", "shared-prefix"]]
)
@pytest.mark.parametrize(
    ("flag", "on"),
    [([], True), (["--no-enable-prefix-caching"], False), (["--enable-prefix-caching"], True)],
)
def test_prefix_caching_flag_reaches_the_engine(monkeypatch, command, flag, on):
    from tinyllm.entrypoints import args as args_module
    from tinyllm.entrypoints import llm as llm_module

    seen = {}
    monkeypatch.setattr(llm_module, "LLM", lambda **kwargs: seen.update(kwargs))
    args_module.build_llm(cli.build_parser().parse_args(command + flag))
    assert seen["enable_prefix_caching"] is on


@pytest.mark.parametrize(
    "command", [["serve"], ["chat"], ["bench", "single"], ["bench", "shared-prefix"]]
)
def test_the_model_is_positional_or_a_flag(command):
    parse = cli.build_parser().parse_args
    assert parse(command + ["m.gguf"]).model == "m.gguf"
    assert parse(command + ["--block-size", "8", "m.gguf", "-tp", "2"]).model == "m.gguf"
    assert parse(command + ["--model", "m.gguf"]).model == "m.gguf"
    assert parse(command + ["m.gguf", "--model", "m.gguf"]).model == "m.gguf"
    assert parse(command).model is None


@pytest.mark.parametrize(
    "args", [["serve", "a.gguf", "--model", "b.gguf"], ["chat", "--model", "b.gguf", "a.gguf"]]
)
def test_two_different_models_are_a_usage_error(monkeypatch, capsys, args):
    monkeypatch.setattr(cli, "build_llm", lambda args: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(args)
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"tinyllm {args[0]}: error: two models given") and "b.gguf" in last


def test_generate_takes_the_prompt_positionally_and_the_model_as_a_flag():
    args = cli.build_parser().parse_args(["generate", "Hi", "--model", "m.gguf"])
    assert (args.prompt, args.model) == ("Hi", "m.gguf")


def test_every_option_field_is_a_flag_with_its_default_and_choices():
    """The flags are made from the config fields: each field's default, choices and help."""
    parser = next(p for p in cli.iter_parsers(cli.build_parser()) if p.prog == "tinyllm serve")
    flags = {a.dest: a for a in _options(parser)}
    args = parser.parse_args([])
    for cls in OPTION_CLASSES:
        for f in option_fields(cls):
            action = flags[f.name]
            assert action.default == f.default == getattr(args, f.name), f.name
            assert action.help == f.metadata["help"] and action.choices == f.metadata["choices"]
    assert set(engine_options(args)) == {f.name for c in OPTION_CLASSES for f in option_fields(c)}
    assert "-tp" in flags["tensor_parallel_size"].option_strings
    assert "--no-enable-prefix-caching" in flags["enable_prefix_caching"].option_strings


def test_llm_names_an_unknown_option_before_loading():
    from tinyllm import LLM

    with pytest.raises(TypeError, match="unknown option.* max_num_seq, tensor_parallel: LLM"):
        LLM(max_num_seq=4, tensor_parallel=2)


def test_help_imports_no_torch():
    """`tinyllm COMMAND --help` stays quick: the options' homes import no torch."""
    code = (
        "import sys\n"
        "from tinyllm.entrypoints import cli\n"
        "for p in cli.iter_parsers(cli.build_parser()): p.format_help()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"
