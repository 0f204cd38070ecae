"""Builds the CPU kernels as a plain shared library (C ABI, loaded with ctypes; no torch)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "spore_kernels._cpu",
            sources=["csrc/cpu_kernels.cpp"],
            language="c++",
            extra_compile_args=["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno"],
            extra_link_args=["-fopenmp"],
        )
    ]
)
