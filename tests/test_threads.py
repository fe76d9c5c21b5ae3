"""Threads: LLM(threads=...) sets torch's pool before loading; a busy machine is named once."""

import logging

import pytest
import torch

from tinyllm.entrypoints import llm as llm_module
from tinyllm.host import threads


class _Loaded(Exception):
    """Raised by the stand-in loader: the test has seen what it needs, nothing loads."""


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_llm_threads_are_set_before_loading(monkeypatch, restore_threads):
    seen = []

    def load_model(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise _Loaded

    monkeypatch.setattr(llm_module, "load_model", load_model)
    torch.set_num_threads(2)
    with pytest.raises(_Loaded):
        llm_module.LLM(threads=1, device="cpu")
    assert seen == [1]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_llm_refuses_a_bad_thread_count_before_loading(monkeypatch, bad):
    monkeypatch.setattr(llm_module, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ValueError, match="threads=.* must be an integer >= 1"):
        llm_module.LLM(threads=bad, device="cpu")


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A fake /proc/loadavg and core count: `machine(running, cores)`."""
    monkeypatch.setattr(threads, "_warned", False)
    monkeypatch.setattr(threads, "_SAMPLE_GAP_S", 0)
    loadavg = tmp_path / "loadavg"
    monkeypatch.setattr(threads, "_LOADAVG", str(loadavg))

    def set_machine(running: int, cores: int) -> None:
        loadavg.write_text(f"2.10 1.90 1.50 {running}/321 4567\n")
        monkeypatch.setattr(threads, "allowed_cores", lambda: cores)

    return set_machine


def test_busy_machine_warns_once_with_the_numbers_and_the_fix(machine, caplog):
    machine(running=3, cores=2)  # two other threads runnable besides the reader
    with caplog.at_level(logging.WARNING, logger="tinyllm"):
        assert threads.warn_if_oversubscribed(2)
        assert not threads.warn_if_oversubscribed(2)  # once per process
    [record] = caplog.records
    message = record.getMessage()
    assert "2 other runnable thread(s) besides tinyllm's 2, on 2 core(s)" in message
    assert all(fix in message for fix in ("--threads 1", "OMP_NUM_THREADS=1", "LLM(threads=1)"))


@pytest.mark.parametrize(
    ("running", "cores", "ours", "warns"),
    [
        (1, 2, 2, False),  # quiet: only the reader runs
        (2, 2, 2, True),  # one busy thread on a 2-core machine: 3 runnable on 2 cores
        (2, 4, 2, False),  # the same on 4 cores fits
        (5, 2, 1, False),  # one thread of ours is the fix: never warned about
    ],
)
def test_the_rule_counts_other_work_plus_our_threads_against_the_cores(
    machine, running, cores, ours, warns
):
    machine(running=running, cores=cores)
    assert threads.warn_if_oversubscribed(ours) == warns


def test_a_passing_task_is_not_mistaken_for_load(monkeypatch, machine):
    """One read can catch a short-lived process; the fewest runnable of several reads counts."""
    machine(running=1, cores=2)
    reads = iter([4, 1, 4, 4, 4])
    monkeypatch.setattr(threads, "_running_now", lambda: next(reads))
    assert not threads.warn_if_oversubscribed(2)


def test_no_loadavg_means_no_warning(machine, monkeypatch, tmp_path):
    monkeypatch.setattr(threads, "_LOADAVG", str(tmp_path / "missing"))
    assert threads.other_runnable_threads() is None
    assert not threads.warn_if_oversubscribed(2)
