"""The one compiled part: the int8 codec's hot loops (diloco/codec/_int8_native.c).

Optional: where it does not compile (no C compiler), the install goes on and the int8 codec
takes its torch path, which gives the same bytes (tests/test_codec_native.py).
-ffp-contract=off: no fused multiply-add may change a rounding against the torch path.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "diloco.codec._int8_native",
            ["diloco/codec/_int8_native.c"],
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"],
            optional=True,
        )
    ]
)
