"""Builds the CPU kernels as plain shared libraries (C ABI, loaded with ctypes; no torch).

On x86-64 the sources are compiled three times — for x86-64-v4 (AVX-512), x86-64-v3 (AVX2,
FMA, F16C) and the baseline — and ``spore_kernels._lib`` loads the best one this CPU runs.
Elsewhere there is one baseline build.
"""

import os
import platform
from glob import glob

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = sorted(glob("csrc/*.cpp"))
# -fno-trapping-math: without it GCC will not if-convert a select whose arms can raise a
# floating-point exception (``v >= 0 ? a : a * z``), and the elementwise loops stay scalar.
FLAGS = [
    "-O3",
    "-std=c++17",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fvisibility=hidden",
]
X86 = platform.machine().lower() in {"x86_64", "amd64"}
ISAS = {"v4": ["-march=x86-64-v4", "-mprefer-vector-width=512"], "v3": ["-march=x86-64-v3"]}


def extension(isa: str, arch: list[str]) -> Extension:
    return Extension(
        f"spore_kernels._cpu_{isa}",
        sources=SOURCES,
        depends=glob("csrc/*.h"),
        language="c++",
        extra_compile_args=[*FLAGS, *arch],
        extra_link_args=["-fopenmp"],
    )


class PerExtensionTemp(build_ext):
    """Each ISA compiles the same sources: give each its own object directory.

    Extensions build one after another even under ``-j``: the per-extension directory is set on
    the shared command object, so parallel builds would mix one ISA's objects into another's.
    """

    def build_extensions(self) -> None:
        self.parallel = None
        super().build_extensions()

    def build_extension(self, ext: Extension) -> None:
        base = self.build_temp
        self.build_temp = os.path.join(base, ext.name)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = base


builds = [extension(isa, arch) for isa, arch in ISAS.items()] if X86 else []
setup(ext_modules=[*builds, extension("base", [])], cmdclass={"build_ext": PerExtensionTemp})
