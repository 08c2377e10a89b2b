"""Metadata lives in setup.cfg; this file only builds the optional C accelerator."""
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """Build the accelerator when a compiler is there; fall back to pure Python otherwise."""

    def run(self):
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - any build failure means "no accelerator"
            print(f"streamproto: C accelerator not built ({e}); using pure Python")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            print(f"streamproto: {ext.name} not built ({e}); using pure Python")


setup(
    ext_modules=[Extension("streamproto._speedups", ["streamproto/_speedups.c", "streamproto/_syncer.c",
                                                      "streamproto/_sender.c"],
                           depends=["streamproto/_forks.h", "streamproto/_syncer.h",
                                    "streamproto/_sender.h"], optional=True)],
    cmdclass={"build_ext": OptionalBuildExt},
)
