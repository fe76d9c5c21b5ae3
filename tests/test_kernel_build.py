"""tinyllm's CPU kernels as installs build and load them (model/cpu_library.py, setup.py): a
library per instruction-set level, loaded by the CPU's; installs that never rebuild each
other's; a build at first use that a killed process does not block."""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest
import torch

from tinyllm.model import cpu_library

ROOT = Path(__file__).parents[1]
# A start as a user's: load the library, then print the library files in this process's memory.
START = """
import logging
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from tinyllm.model.cpu_library import library_error
assert library_error() is None, library_error()
maps = open("/proc/self/maps").read().splitlines()
print(*sorted({line.split()[-1] for line in maps if "tinyllm_cpu_" in line}))
"""
LOADED = re.compile(r"tinyllm's CPU kernels \((\w+)\) loaded in (\d+\.\d) s from (\S+)")


def start(python: str, env: dict[str, str], cwd: Path) -> tuple[list[Path], str]:
    """Run START; the libraries it loaded, and its log."""
    done = subprocess.run(
        [python, "-c", START], env=env, cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [Path(p) for p in done.stdout.split()], done.stderr


def environment(**changes: str | None) -> dict[str, str]:
    """This process's environment with `changes` (None: unset), without a forced level unless
    `changes` names one."""
    env = {k: v for k, v in os.environ.items() if k != "TINYLLM_CPU_LEVEL"} | changes
    return {k: v for k, v in env.items() if v is not None}


def runs(level: str) -> bool:
    has = torch.cpu.get_capabilities()
    return all(has.get(ext) for ext in cpu_library.NEEDS[level])


def test_an_install_builds_the_levels_this_cpu_runs_or_all_when_asked(monkeypatch):
    """What setup.py builds: this CPU's level and every one below it, which this CPU runs too;
    TINYLLM_KERNEL_LEVELS=all adds the levels above, for a wheel to hand out."""
    monkeypatch.delenv("TINYLLM_KERNEL_LEVELS", raising=False)
    monkeypatch.delenv("TINYLLM_CPU_LEVEL", raising=False)
    levels = cpu_library.install_levels()
    assert cpu_library.level() in levels and "generic" in levels
    assert levels == [level for level in cpu_library.LEVELS if runs(level)]
    monkeypatch.setenv("TINYLLM_KERNEL_LEVELS", "all")
    assert cpu_library.install_levels() == list(cpu_library.LEVELS)


@pytest.mark.slow
def test_a_lower_level_asked_for_loads_its_own_library(monkeypatch):
    """TINYLLM_CPU_LEVEL names a level below this CPU's: its library is the one in memory. A level
    above, which this CPU cannot run, loads this CPU's own, with the warning."""
    monkeypatch.delenv("TINYLLM_CPU_LEVEL", raising=False)
    own = cpu_library.level()
    order = list(cpu_library.LEVELS)  # best first
    lower = next((level for level in order[order.index(own) + 1 :] if runs(level)), None)
    if lower is None:
        pytest.skip(f"this CPU's level, {own}, is the lowest")
    env = environment(PYTHONPATH=str(ROOT), TINYLLM_CPU_LEVEL=lower)
    loaded, log = start(sys.executable, env, ROOT)
    assert [p.name for p in loaded] == [cpu_library.library_file(lower)], log
    assert LOADED.search(log)[1] == lower
    above = next((level for level in cpu_library.LEVELS if not runs(level)), None)
    if above is not None:
        loaded, log = start(sys.executable, {**env, "TINYLLM_CPU_LEVEL": above}, ROOT)
        assert [p.name for p in loaded] == [cpu_library.library_file(own)], log
        assert f"TINYLLM_CPU_LEVEL={above} needs " in log
        assert f"which this CPU lacks: using this CPU's level, {own}" in log


def checkout(to: Path) -> Path:
    """A copy of the package's sources, as a checkout used without installing: no libraries."""
    ignore = shutil.ignore_patterns("kernels", "__pycache__")
    shutil.copytree(ROOT / "tinyllm", to / "tinyllm", ignore=ignore)
    return to


@pytest.mark.slow
def test_a_build_killed_midway_does_not_block_the_next_start(tmp_path):
    """A first use compiling the library, killed midway (SIGKILL: nothing of its own cleans up,
    and its compilers live on): the next start neither waits for it nor trips over what it left,
    and builds and loads the library."""
    source = checkout(tmp_path / "checkout")
    kernels = source / "tinyllm" / "model" / "kernels"
    env = environment(PYTHONPATH=str(source), TINYLLM_CPU_LEVEL="generic")
    first = subprocess.Popen(
        [sys.executable, "-c", START], env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True
    )
    try:
        for line in first.stderr:
            if line.startswith("WARNING compiling tinyllm's CPU kernels"):
                break
        time.sleep(3)  # the compilers at work
        assert first.poll() is None and list(kernels.glob("build-*"))
    finally:
        first.kill()
        first.wait()
    loaded, log = start(sys.executable, env, tmp_path)
    assert "waiting" not in log
    assert re.search(r"tinyllm's CPU kernels \(generic\) compiled in", log), log
    assert loaded == [kernels / cpu_library.library_file("generic")]
    assert not list(kernels.glob("build-*"))  # the killed build's work folder is gone too


HOLD = """
import fcntl, os, sys, time
f = open(sys.argv[1], "a+")
fcntl.flock(f, fcntl.LOCK_EX)
f.write(f"{os.getpid()}\\n")
f.flush()
print("held", flush=True)
time.sleep(120)
"""


def test_a_held_lock_is_waited_for_by_name_and_a_dead_holders_is_not(tmp_path, monkeypatch, caplog):
    """A process building the library holds its lock: another says what it waits for and which
    file to delete, and gives up waiting after LOCK_TIMEOUT. Once the holder is killed, the lock
    is free at once."""
    path = tmp_path / "tinyllm_cpu_generic.so.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        monkeypatch.setattr(cpu_library, "LOCK_TIMEOUT", 1.0)
        with caplog.at_level("WARNING", logger="tinyllm"), cpu_library._lock(path, "generic"):
            pass
    finally:
        holder.kill()
        holder.wait()
    waiting, gave_up = caplog.messages
    assert waiting.startswith(
        f"waiting for process {holder.pid}, which is compiling tinyllm's CPU kernels for generic"
    )
    assert waiting.endswith(f"if no such process runs, delete {path})")
    assert gave_up.startswith(f"not waiting for process {holder.pid} any longer (still at it")
    caplog.clear()
    with caplog.at_level("WARNING", logger="tinyllm"), cpu_library._lock(path, "generic"):
        assert path.read_text() == f"{os.getpid()}\n"
    assert caplog.text == ""


def make_venv(path: Path) -> str:
    """A virtual environment that sees this one's packages (torch and the rest), not tinyllm."""
    venv.create(path, with_pip=False)
    python = str(path / "bin" / "python")
    here = sysconfig.get_path("purelib")
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = subprocess.check_output([python, "-c", where], text=True).strip()
    (Path(site) / "outer.pth").write_text(here + "\n")
    return python


@pytest.mark.slow
def test_two_installs_start_one_after_the_other_without_compiling(tmp_path):
    """The package installed in two virtual environments (one wheel, built here): each start
    loads its own install's library, in well under a few seconds, and none compiles."""
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(wheels), str(ROOT)],
        check=True, capture_output=True, timeout=1200,
    )  # fmt: skip
    (wheel,) = wheels.glob("tinyllm-*.whl")
    built = {Path(n).name for n in zipfile.ZipFile(wheel).namelist() if "tinyllm_cpu_" in n}
    # Every level this CPU runs (AMX's flags need GCC 11 or later).
    assert {cpu_library.library_file(level) for level in cpu_library.install_levels()} - built <= {
        cpu_library.library_file("avx512amx")
    }
    pythons = []
    for name in ("a", "b"):
        python = make_venv(tmp_path / name)
        subprocess.run(
            [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
             "--ignore-installed", str(wheel)],  # this environment's tinyllm stays
            check=True, capture_output=True, timeout=600,
        )  # fmt: skip
        pythons.append(python)
    env = environment(PYTHONPATH=None)
    for python in pythons * 2:
        loaded, log = start(python, env, tmp_path)
        assert "compiling" not in log
        level, seconds, path = LOADED.search(log).groups()
        assert float(seconds) < 3
        assert loaded == [Path(path)]
        assert Path(path).is_relative_to(Path(python).parents[1]), path
        kernels = Path(path).parent
        assert sorted(p.name for p in kernels.iterdir()) == sorted(built)  # nothing built


def test_readme_installs_the_build_requirements_and_ci_runs_its_commands():
    """README's first command installs pyproject.toml's build requirements, as they are written
    there, before building without isolation; .ci/run makes the same installs and runs README's
    second command verbatim."""
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    readme = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    first, second = readme.strip().splitlines()
    build_install = first.split(" && ")[1]
    assert sorted(build_install.replace("'", "").split()[2:]) == sorted(requires)
    assert ".venv/bin/pip install --no-build-isolation -e ." in first.split(" && ")
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"{build_install.replace(' install ', ' install -q ', 1)}\n" in ci
    assert ci.rstrip().endswith(second)
