"""The benchmark workloads and `tinyllm bench` as a user runs it."""

import subprocess
import sys

import pytest

from tinyllm.entrypoints.workloads import WORKLOADS, make_requests


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workloads_are_reproducible_and_in_range(name):
    w = WORKLOADS[name]
    a, b = make_requests(name, 49152, seed=3), make_requests(name, 49152, seed=3)
    assert a == b and a != make_requests(name, 49152, seed=4)
    assert len(a) == w.num_requests
    for r in a:
        own = len(r.prompt_token_ids) - w.shared_prefix
        assert w.prompt_len[0] <= own <= w.prompt_len[1]
        assert w.output_len[0] <= r.max_tokens <= w.output_len[1]
        assert all(100 <= t < 49152 - 100 for t in r.prompt_token_ids)
    if w.shared_prefix:
        assert len({tuple(r.prompt_token_ids[: w.shared_prefix]) for r in a}) == 1


@pytest.mark.slow
def test_bench_prints_both_engines_and_the_ratio():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tinyllm.entrypoints.cli",
            "bench",
            "offline-small",
            "--num-requests",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.strip()}
    assert rows["tinyllm"][1] == rows["transformers"][1] == "2"
    assert rows["tinyllm"][2] == rows["transformers"][2]  # same output tokens counted
    assert rows["tinyllm/transformers"][1].endswith("x")
    assert float(rows["tinyllm/transformers"][1][:-1]) > 0
