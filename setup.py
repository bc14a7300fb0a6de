"""Declares the C extension only; all metadata lives in pyproject.toml."""
import os

from setuptools import Extension, setup

extra = ["-O3", "-std=c99", "-Wall", "-Werror=implicit-function-declaration"]
if os.environ.get("DELTACKPT_NATIVE_MARCH", "1") == "1":
    extra.append("-march=x86-64-v2") if os.uname().machine == "x86_64" else None
# `make asan`: AddressSanitizer and UBSan (after -O3, so -O1 wins); the library is preloaded by the test run.
sanitize = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1", "-g"]
link = sanitize[:1] if os.environ.get("DELTACKPT_NATIVE_SANITIZE") == "1" else []
extra += sanitize if link else []

setup(
    ext_modules=[
        Extension(
            "deltackpt._native",
            sources=["native/binding.c", "native/shuffle.c", "native/sparse.c", "native/fastcdc.c", "native/refs.c",
                     "native/chunkcheck.c"],
            include_dirs=["native"],
            depends=["native/dc_kernels.h", "native/third_party/xxhash/xxhash.h"],
            extra_compile_args=extra,
            extra_link_args=link,
        )
    ]
)
