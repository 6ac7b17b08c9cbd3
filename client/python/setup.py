"""pip install client/python: builds sparsebalance._C with the project's CMake build and
installs the package `sparsebalance`.

    pip install --no-build-isolation client/python            # offline: uses the system's setuptools
    SB_BUILD_DIR=build pip install --no-build-isolation client/python   # reuse a configured build

Needs what the C++ build needs (scripts/install-deps.sh: gRPC, protobuf, Abseil, pybind11,
python3-dev). Environment:
  SB_BUILD_DIR    a CMake build directory to reuse (configured here when it has no cache yet);
                  default: a fresh one under setuptools' build_temp
  SB_CMAKE_ARGS   extra configure arguments, e.g. "-DSB_WITH_CUDA=OFF"
  SB_BUILD_JOBS   parallel build jobs (default: the CPU count)
  SB_SOURCE_DIR   the SparseBalance source tree (default: two levels above this file)
"""

import os
import pathlib
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = pathlib.Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        source = pathlib.Path(os.environ.get("SB_SOURCE_DIR") or HERE.parent.parent).resolve()
        if not (source / "client" / "python" / "CMakeLists.txt").exists():
            sys.exit(f"sparsebalance: {source} is not the SparseBalance source tree (pip may "
                     "have copied client/python alone): set SB_SOURCE_DIR to the checkout")
        build = pathlib.Path(os.environ.get("SB_BUILD_DIR") or
                             pathlib.Path(self.build_temp).resolve() / "cmake").resolve()
        if not (build / "CMakeCache.txt").exists():
            configure = ["cmake", "-S", str(source), "-B", str(build),
                         "-DCMAKE_BUILD_TYPE=Release", "-DSB_BUILD_TESTS=OFF",
                         "-DSB_BUILD_BENCHMARKS=OFF", "-DSB_BUILD_PYTHON=ON",
                         f"-DPython3_EXECUTABLE={sys.executable}"]
            if shutil.which("ninja"):
                configure += ["-G", "Ninja"]
            configure += shlex.split(os.environ.get("SB_CMAKE_ARGS", ""))
            subprocess.run(configure, check=True)
        jobs = os.environ.get("SB_BUILD_JOBS") or str(os.cpu_count() or 1)
        subprocess.run(["cmake", "--build", str(build), "--target", "sb_python", "-j", jobs],
                       check=True)
        built = sorted((build / "client" / "python" / "sparsebalance").glob("_C*.so"))
        if not built:
            sys.exit(f"sparsebalance: no _C module under {build}/client/python/sparsebalance "
                     "(is SB_BUILD_PYTHON on in that build?)")
        target = pathlib.Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[-1], target)
        os.chmod(target, 0o755)


setup(
    packages=["sparsebalance"],
    ext_modules=[CMakeExtension("sparsebalance._C")],
    cmdclass={"build_ext": CMakeBuild},
)
