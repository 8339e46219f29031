"""Build hook for the optional C extension ``topkv._copycrc`` (everything else is in pyproject).

The extension is optional: without a C compiler the install still succeeds and the shm
transport falls back to awscrt + numpy (slower; see docs/transports.md).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "topkv._copycrc",
            sources=["src/topkv/_copycrc.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
