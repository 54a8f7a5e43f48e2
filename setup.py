"""Build pycoll._C with CMake + pybind11. Static metadata lives in pyproject.toml.

Environment:
  PYCOLL_WITH_CUDA   auto (default) | 0 | 1. auto builds the CUDA kernels when nvcc is
                     found (PATH, $CUDA_HOME/bin, $CUDA_PATH/bin) and falls back to a
                     CPU-only build, with a warning, if the CUDA build fails.
  PYCOLL_CUDA_ARCHS  CUDA architectures, default "75;80;90".
  CMAKE_BUILD_PARALLEL_LEVEL, CMAKE_ARGS  passed through to CMake.
"""
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


def find_cmake():
    cmake = shutil.which("cmake")
    if cmake:
        return cmake
    try:  # the `cmake` package from PyPI, if the user installed it
        import cmake as cmake_pkg

        return os.path.join(cmake_pkg.CMAKE_BIN_DIR, "cmake")
    except ImportError:
        raise RuntimeError("pycoll: cmake (>= 3.18) not found; install it (e.g. `pip install cmake`)") from None


def find_nvcc():
    nvcc = shutil.which("nvcc")
    if nvcc:
        return nvcc
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return None


def warn(msg):
    print(f"\n*** pycoll WARNING: {msg}\n", file=sys.stderr, flush=True)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        mode = os.environ.get("PYCOLL_WITH_CUDA", "auto").strip().lower() or "auto"
        if mode not in ("auto", "0", "1"):
            raise RuntimeError(f"pycoll: PYCOLL_WITH_CUDA must be auto, 0 or 1, got {mode!r}")
        nvcc = find_nvcc() if mode != "0" else None
        if mode == "1" and not nvcc:
            raise RuntimeError(
                "pycoll: PYCOLL_WITH_CUDA=1 but nvcc was not found (looked on PATH, $CUDA_HOME/bin, "
                "$CUDA_PATH/bin). Install the CUDA toolkit and put nvcc on PATH, or set "
                "PYCOLL_WITH_CUDA=0 to build the CPU kernels only."
            )
        if nvcc:
            try:
                return self.cmake_build(ext, nvcc)
            except subprocess.CalledProcessError:
                if mode == "1":
                    raise
                warn("the CUDA build failed (see the errors above); retrying without CUDA. "
                     "pycoll._C.has_cuda() will be False. Set PYCOLL_WITH_CUDA=1 to make this an error.")
        self.cmake_build(ext, None)

    def cmake_build(self, ext, nvcc):
        outdir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        # Separate trees so a failed CUDA configure never poisons the CPU retry.
        build_dir = Path(self.build_temp).resolve() / ("cmake-cuda" if nvcc else "cmake-cpu")
        build_dir.mkdir(parents=True, exist_ok=True)
        import pybind11

        args = [
            f"-DCMAKE_BUILD_TYPE={'Debug' if self.debug else 'Release'}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DPYCOLL_OUTPUT_DIR={outdir}",
            f"-DPYCOLL_WITH_CUDA={'ON' if nvcc else 'OFF'}",
        ]
        if nvcc:
            args += [f"-DCMAKE_CUDA_COMPILER={nvcc}",
                     f"-DPYCOLL_CUDA_ARCHS={os.environ.get('PYCOLL_CUDA_ARCHS', '75;80;90')}"]
        if shutil.which("ninja") and "CMAKE_GENERATOR" not in os.environ:
            args += ["-G", "Ninja"]
        args += shlex.split(os.environ.get("CMAKE_ARGS", ""))

        cmake = find_cmake()
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(self.parallel or os.cpu_count() or 1)
        print(f"pycoll: building _C {'with CUDA (' + nvcc + ')' if nvcc else 'CPU-only'} in {build_dir}", flush=True)
        start = time.monotonic()
        subprocess.run([cmake, "-S", str(ROOT), "-B", str(build_dir)] + args, check=True)
        subprocess.run([cmake, "--build", str(build_dir), "--parallel", jobs], check=True)
        print(f"pycoll: _C built in {time.monotonic() - start:.1f}s", flush=True)


setup(
    packages=find_packages(include=["pycoll", "pycoll.*"]) + ["pycoll.launch"],
    package_dir={"pycoll.launch": "launch"},
    ext_modules=[CMakeExtension("pycoll._C")],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
