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
from setuptools.command.build_ext import build_ext


def _flag(name):
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


SANITIZE = _flag("ECHO_NATIVE_SANITIZE")
DEBUG = SANITIZE or _flag("ECHO_NATIVE_DEBUG")

compile_args = ["-fvisibility=hidden", "-Wall", "-Wno-unused-function"]
# Per source language.  The C++ is kernels.cu built for the host (src/kernel/en_ops.cpp):
# -ffp-contract=off keeps its arithmetic that of NVRTC's --fmad=false, even under
# -march=native; it needs neither exceptions nor RTTI.
language_args = {
    ".c": ["-std=c11"],
    ".cpp": ["-std=c++14", "-ffp-contract=off", "-fno-exceptions", "-fno-rtti"],
}
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


class BuildExt(build_ext):
    """build_ext passing each source the flags of its language (setuptools has one list
    for every source of an extension)."""

    def build_extensions(self):
        compile_one = self.compiler._compile

        def _compile(obj, src, ext, cc_args, extra_postargs, pp_opts):
            extra = language_args[os.path.splitext(src)[1]]
            return compile_one(obj, src, ext, cc_args, list(extra_postargs) + extra, pp_opts)

        self.compiler._compile = _compile
        super().build_extensions()


def ext(name, sources, libraries=(), include_dirs=()):
    include_dirs = [os.path.dirname(sources[0]), *include_dirs, numpy.get_include()]
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
         "src/kernel/en_augment.c", "src/kernel/en_ops.cpp"],
        libraries=["jpeg", "m"],
        # en_ops.cpp includes the CUDA kernels' source, one arithmetic for both devices.
        include_dirs=["echo_native/backends"],
    ),
    ext("echo_native._ring", ["src/ring/_ring.pyx", "src/ring/en_ring.c"], ["rt"]),
    ext("echo_native._dlpack", ["src/dlpack/_dlpack.pyx"]),
    ext("echo_native.lab._bench", ["src/bench/_bench.pyx", "src/bench/roi_ceiling.c"], ["jpeg"]),
]

setup(ext_modules=cythonize(EXTENSIONS, compiler_directives=directives,
                            build_dir="build/cython"),
      cmdclass={"build_ext": BuildExt})
