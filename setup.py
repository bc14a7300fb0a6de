"""Declares the C extension only; all metadata lives in pyproject.toml."""
import os

from setuptools import Extension, setup

extra = ["-O3", "-std=c99", "-Wall", "-Werror=implicit-function-declaration"]
if os.environ.get("DELTACKPT_NATIVE_MARCH", "1") == "1":
    extra.append("-march=x86-64-v2") if os.uname().machine == "x86_64" else None

setup(
    ext_modules=[
        Extension(
            "deltackpt._native",
            sources=["native/binding.c", "native/shuffle.c", "native/sparse.c", "native/fastcdc.c", "native/refs.c",
                     "native/chunkcheck.c"],
            include_dirs=["native"],
            depends=["native/dc_kernels.h", "native/third_party/xxhash/xxhash.h"],
            extra_compile_args=extra,
        )
    ]
)
