"""Builds dvm's VM (csrc/) as plain shared libraries: C ABI, no torch headers, loaded with
ctypes by ``dvm._lib``; ``dvm._launcher`` (csrc/launcher.c), a CPython extension that
calls a build's ``dvm_run`` by address for ``dvm.vm.Launch`` and prepares a compiled region's
launch (``prepare``; no torch headers either); ``dvm._emitter`` (csrc/emitter.c), the program
builder behind ``dvm.lower.Emitter`` and ``dvm.cluster.build_region``;
``dvm._analysis`` (csrc/analysis.c), the per-node analysis behind ``dvm.cluster._Analysis``,
with ``compile`` (csrc/compile.c), the common case of ``dvm.compile.compile_graph`` in one call;
and ``dvm._executor`` (csrc/executor.c), the schedule's common case and the steps of
``dvm.executor.Executor``.

x86-64 gets one build per ISA level — ``dvm._vm_v4`` (AVX-512), ``dvm._vm_v3`` (AVX2, FMA,
F16C) and ``dvm._vm_base`` — and the loader picks the best this CPU runs; other machines get
the base build only.
"""

import os
import platform
from glob import glob

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

COMMON = [
    "-O3",
    "-std=c++17",
    "-fopenmp",
    "-fno-math-errno",  # sqrt and friends without errno: vectorisable
    "-fno-trapping-math",  # lets GCC if-convert selects whose arms may raise FP flags
    "-ffp-contract=fast",  # fused multiply-adds in the polynomials where the ISA has them
    "-fvisibility=hidden",
]
LEVELS = {"v4": ["-march=x86-64-v4", "-mprefer-vector-width=512"], "v3": ["-march=x86-64-v3"]}
if platform.machine().lower() not in {"x86_64", "amd64"}:
    LEVELS = {}
LEVELS["base"] = []


class IsaBuildExt(build_ext):
    """The ISA builds share sources: each gets its own object directory, one after another."""

    def build_extensions(self) -> None:
        self.parallel = None
        super().build_extensions()

    def build_extension(self, ext: Extension) -> None:
        shared_temp = self.build_temp
        self.build_temp = os.path.join(shared_temp, ext.name.rpartition(".")[2])
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = shared_temp


setup(
    ext_modules=[
        Extension(
            f"dvm._vm_{level}",
            sources=["csrc/vm.cpp"],
            depends=sorted(glob("csrc/*.h")),
            language="c++",
            extra_compile_args=COMMON + flags,
            extra_link_args=["-fopenmp"],
        )
        for level, flags in LEVELS.items()
    ]
    + [
        # the compile's C modules run once per graph or region, with cold caches: optimised for
        # size, they touch fewer lines of code
        Extension(
            f"dvm.{name}",
            sources=[f"csrc/{name[1:]}.c", *extra],
            depends=sorted(glob("csrc/*.h")),
            extra_compile_args=["-Os"],
            # dladdr, which checks a launch's run address (in libc itself from glibc 2.34)
            libraries=["dl"] if name == "_launcher" and os.name == "posix" else [],
        )
        for name, extra in (
            ("_launcher", []),
            ("_emitter", []),
            ("_analysis", ["csrc/compile.c"]),  # the whole compile's common case too
            ("_executor", []),
        )
    ],
    cmdclass={"build_ext": IsaBuildExt},
)
