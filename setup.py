"""Build script for the native planner kernels (small C files, no third-party headers)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tightpack.core._firstfit",
            sources=["src/tightpack/core/_firstfit.c", "src/tightpack/core/_first_fit_apart.c"],
            depends=["src/tightpack/core/_firstfit.h"],
            extra_compile_args=["-O3"],
        ),
        Extension(
            "tightpack.core._global_batches",
            sources=[
                "src/tightpack/core/_global_batches.c",
                "src/tightpack/core/_batch_copies.c",
                "src/tightpack/core/_batch_exchanges.c",
                "src/tightpack/core/_batch_order.c",
            ],
            depends=["src/tightpack/core/_global_batches.h"],
            extra_compile_args=["-O3"],
        ),
    ]
)
