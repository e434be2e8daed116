"""Build glue that pyproject.toml cannot express: the planner's C++ extension, and csrc/ shipped as data.

csrc/ lives at the top level (framework-free CUDA C++, see DESIGN.md); an installed fi_backend finds
it at fi_backend/_csrc, a source checkout at ../csrc.
"""
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithCsrc(build_py):
    def run(self):
        super().run()
        dest = Path(self.build_lib) / "fi_backend" / "_csrc"
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(ROOT / "csrc", dest, ignore=shutil.ignore_patterns("*.o", "*.so", "__pycache__"))


# The binding takes arrays through the buffer protocol, which joined the limited API in Python 3.11:
# stable ABI (abi3, 3.11+) there, the full API on 3.10.
_ABI3 = sys.version_info >= (3, 11)
planner = Extension(
    "fi_backend._planner",
    sources=["csrc/scheduler/planner.cc", "csrc/scheduler/planner_py.cc"],
    include_dirs=["csrc"],
    extra_compile_args=["-O3", "-std=c++17"],
    define_macros=[("Py_LIMITED_API", "0x030B0000")] if _ABI3 else [],
    py_limited_api=_ABI3,
    language="c++",
)

setup(
    packages=["fi_backend", "fi_backend.kernels", "fi_backend.adapters"],
    ext_modules=[planner],
    cmdclass={"build_py": BuildPyWithCsrc},
    # A wheel built here installs on every later Python (e.g. built on 3.11, run on the GPU machine's 3.12).
    options={"bdist_wheel": {"py_limited_api": "cp311"}} if _ABI3 else {},
)
