"""Build script for the native planner kernels (one small C file, no third-party headers)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tightpack.core._firstfit",
            sources=["src/tightpack/core/_firstfit.c"],
            extra_compile_args=["-O3"],
        )
    ]
)
