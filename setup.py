"""Builds tinyllm's C++ CPU kernels with the package (pyproject.toml holds everything else):
one library per instruction-set level this CPU runs (cpu_library.install_levels) that the
compiler takes, into tinyllm/model/kernels/, where tinyllm/model/cpu_library.py loads the one
for the CPU's level. An editable install (a checkout, which runs where it is) builds this CPU's
level alone."""

import importlib.util
import logging
import os
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent
SPEC = importlib.util.spec_from_file_location("cpu_library", ROOT / "tinyllm/model/cpu_library.py")
cpu_library = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(cpu_library)


class BuildKernels(build_ext):
    """Compiles every level at once, with the commands a build at first use runs; a level the
    compiler rejects (AMX's flags before GCC 11) is left out, with a warning. A library that this
    checkout already holds (cpu_library.KERNELS: an earlier install, or a first use) is the same
    file by its name, built from the same sources and flags: it is copied, not compiled again."""

    def get_ext_filename(self, fullname: str) -> str:
        # Libraries that torch loads, named as cpu_library looks for them: not Python modules.
        return str(Path(*fullname.split("."))) + ".so"

    def run(self) -> None:
        if self.inplace:  # an editable install, whose libraries of older sources go
            if os.environ.get("TINYLLM_KERNEL_LEVELS") != "all":
                # A checkout runs where it is: this CPU's level alone (a lower one, asked for
                # with TINYLLM_CPU_LEVEL, compiles at its first use).
                own = cpu_library.level()
                self.extensions = [ext for ext in self.extensions if ext.level == own]
            current = {cpu_library.library_file(ext.level) for ext in self.extensions}
            for old in cpu_library.KERNELS.glob("tinyllm_cpu_*.so"):
                if old.name not in current:
                    old.unlink()
            cpu_library.KERNELS.mkdir(exist_ok=True)
        super().run()

    def build_extensions(self) -> None:
        directory = Path(self.get_ext_fullpath(self.extensions[0].name)).parent
        directory.mkdir(parents=True, exist_ok=True)
        missing = []
        for ext in self.extensions:
            held = cpu_library.KERNELS / cpu_library.library_file(ext.level)
            if held.is_file():
                shutil.copy2(held, directory / held.name)
            else:
                missing.append(ext.level)
        errors = cpu_library.build(missing, directory)
        for level, error in errors.items():  # a first use builds what is missing, or does without
            why = cpu_library.first_error(RuntimeError(error))
            logging.warning("tinyllm's CPU kernels are not built for %s: %s", level, why)
        self.extensions = [ext for ext in self.extensions if ext.level not in errors]

    def copy_extensions_to_source(self) -> None:
        # A library already in place is this one (the same name): writing over it would break a
        # process that has it loaded.
        held = {path.name for path in cpu_library.KERNELS.glob("tinyllm_cpu_*.so")}
        self.extensions = [
            ext for ext in self.extensions if cpu_library.library_file(ext.level) not in held
        ]
        super().copy_extensions_to_source()


def kernel(level: str) -> Extension:
    name = cpu_library.library_file(level).removesuffix(".so")
    ext = Extension(f"tinyllm.model.kernels.{name}", sources=[])
    ext.level, ext.optional = level, True  # optional: a level left out is not copied in place
    return ext


setup(
    ext_modules=[kernel(level) for level in cpu_library.install_levels()],
    cmdclass={"build_ext": BuildKernels},
)
