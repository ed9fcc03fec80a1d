"""Build the compiled core: one table of extensions, flags chosen in one place.

Environment switches:
  ECHO_NATIVE_NATIVE=1    tune for this CPU (-march=native); default builds are portable.
  ECHO_NATIVE_DEBUG=1     Cython bounds checks on, -O1 -g, asserts kept (test builds).
  ECHO_NATIVE_SANITIZE=1  AddressSanitizer + UndefinedBehaviorSanitizer (implies DEBUG).
  ECHO_NATIVE_JPEG_DIR=D  build against D/include and D/lib/libjpeg.so (found there at run
                          time too): for machines without libjpeg-turbo installed, see
                          benchmarks/gpu_prepare.sh.
"""
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup


def _flag(name):
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


SANITIZE = _flag("ECHO_NATIVE_SANITIZE")
DEBUG = SANITIZE or _flag("ECHO_NATIVE_DEBUG")

compile_args = ["-std=c11", "-fvisibility=hidden", "-Wall", "-Wno-unused-function"]
link_args = []
if DEBUG:
    compile_args += ["-O1", "-g", "-fno-omit-frame-pointer", "-UNDEBUG"]
else:
    compile_args += ["-O3"]
if _flag("ECHO_NATIVE_NATIVE"):
    compile_args.append("-march=native")
if SANITIZE:
    san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    compile_args += san
    link_args += san

directives = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": False,
    "cdivision": True,
    "initializedcheck": DEBUG,
    "embedsignature": True,
}


JPEG_DIR = os.environ.get("ECHO_NATIVE_JPEG_DIR")


def ext(name, sources, libraries=()):
    include_dirs = [os.path.dirname(sources[0]), numpy.get_include()]
    library_dirs = []
    if JPEG_DIR and "jpeg" in libraries:
        include_dirs.append(os.path.join(JPEG_DIR, "include"))
        library_dirs.append(os.path.join(JPEG_DIR, "lib"))
    return Extension(
        name,
        sources=sources,
        include_dirs=include_dirs,
        libraries=list(libraries),
        library_dirs=library_dirs,
        runtime_library_dirs=library_dirs,
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )


EXTENSIONS = [
    ext(
        "echo_native._kernel",
        ["src/kernel/_kernel.pyx", "src/kernel/en_jpeg.c", "src/kernel/en_resize.c",
         "src/kernel/en_augment.c"],
        libraries=["jpeg", "m"],
    ),
    ext("echo_native._ring", ["src/ring/_ring.pyx", "src/ring/en_ring.c"], ["rt"]),
    ext("echo_native._dlpack", ["src/dlpack/_dlpack.pyx"]),
    ext("echo_native.lab._bench", ["src/bench/_bench.pyx", "src/bench/roi_ceiling.c"], ["jpeg"]),
]

setup(ext_modules=cythonize(EXTENSIONS, compiler_directives=directives,
                            build_dir="build/cython"))
