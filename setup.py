"""Declares the optional Cython extension expertd._native (remap, drain, row copies).

The build never fails for want of Cython or a compiler: expertd then runs on its pure-Python
twins (expertd/_fallback.py).
"""
from setuptools import setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # no compiler: the pure-Python twin takes over
            print(f"expertd: native extension not built ({exc}); using the pure-Python twin")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"expertd: building {ext.name} failed ({exc}); using the pure-Python twin")


def extensions():
    try:
        from Cython.Build import cythonize
        from setuptools import Extension
    except ImportError:
        return []
    ext = Extension(
        "expertd._native",
        ["cython_ext/_native.pyx"],
        extra_compile_args=["-O3"],
    )
    return cythonize([ext], language_level=3, quiet=True)


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
