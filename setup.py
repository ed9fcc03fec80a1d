"""Build the compiled core: one table of extensions, flags chosen in one place.

Environment switches:
  ECHO_NATIVE_NATIVE=1    tune for this CPU (-march=native); default builds are portable.
  ECHO_NATIVE_DEBUG=1     Cython bounds checks on, -O1 -g, asserts kept (test builds).
  ECHO_NATIVE_SANITIZE=1  AddressSanitizer + UndefinedBehaviorSanitizer (implies DEBUG).
  ECHO_NATIVE_JPEG_DIR=D  build against D/include and D/lib/libjpeg.so (found there at run
                          time too): for machines without libjpeg-turbo installed, see
                          benchmarks/gpu_prepare.sh.

Before anything compiles, a one-file probe with the compiler setuptools chose (CC, CFLAGS,
CPATH and ECHO_NATIVE_JPEG_DIR all apply) checks that jpeglib.h can be included; where it
cannot, the build stops with one line naming the header and the package that provides it.
"""
import os
import subprocess
import tempfile

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import PlatformError


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
JPEG_PACKAGES = "libjpeg62-turbo-dev (Debian/Ubuntu) or libjpeg-turbo-devel (Fedora/RHEL)"
# jpeglib.h uses FILE and size_t without including their headers.
JPEG_PROBE = ("#include <stddef.h>\n#include <stdio.h>\n#include <jpeglib.h>\n"
              "int probe(void) { return JPEG_LIB_VERSION; }\n")


def _probe_compile(cc, source, suffix, include_dirs):
    """Compile ``source`` with the command ``cc``; (ok, the compiler's first error line).
    Output is captured: a failed probe must not print the compiler's own diagnostics."""
    with tempfile.TemporaryDirectory(prefix="echo_native-probe-") as tmp:
        src = os.path.join(tmp, "probe" + suffix)
        with open(src, "w") as f:
            f.write(source)
        cmd = [*cc, *(f"-I{d}" for d in include_dirs), "-c", src,
               "-o", os.path.join(tmp, "probe.o")]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except FileNotFoundError:
            return False, None
    lines = [ln for ln in r.stderr.splitlines() if "error" in ln] or r.stderr.splitlines()
    return r.returncode == 0, (lines[0].strip() if lines else "")


def check_build_requirements(compiler, extensions):
    """Refuse, in one line each, a build that would end in a compiler traceback: no C or
    C++ compiler, or no libjpeg-turbo headers where the extensions look for them."""
    cc = getattr(compiler, "compiler_so", None)
    if not cc:  # not a Unix-style compiler: the build itself reports what is missing
        return
    jpeg_exts = [e for e in extensions if "jpeg" in e.libraries]
    if JPEG_DIR and jpeg_exts:
        # A prefix without the header would silently build against the system's header
        # and link the prefix's library: two versions of one ABI.
        header = os.path.join(JPEG_DIR, "include", "jpeglib.h")
        if not os.path.isfile(header):
            raise PlatformError(f"ECHO_NATIVE_JPEG_DIR={JPEG_DIR} has no include/jpeglib.h: "
                                "point it at a libjpeg-turbo prefix (include/ and lib/), "
                                f"or unset it and install {JPEG_PACKAGES}")
    ok, why = _probe_compile(cc, "int probe(void) { return 0; }\n", ".c", [])
    if not ok:
        if why is None:
            raise PlatformError(f"no C compiler ({cc[0]}) found: install build-essential "
                                "(Debian/Ubuntu) or gcc gcc-c++ (Fedora/RHEL), or install "
                                "echo_native's binary wheel")
        raise PlatformError(f"the C compiler ({' '.join(cc)}) cannot build a test file: {why}")
    if any(s.endswith(".cpp") for e in extensions for s in e.sources):
        ok, why = _probe_compile(cc, "int probe() { return 0; }\n", ".cpp", [])
        if not ok:
            raise PlatformError(f"no C++ compiler for {cc[0]} ({why}): install g++ "
                                "(Debian/Ubuntu) or gcc-c++ (Fedora/RHEL)")
    if jpeg_exts:
        ok, why = _probe_compile(cc, JPEG_PROBE, ".c", jpeg_exts[0].include_dirs)
        if not ok and "jpeglib.h" in why:
            raise PlatformError("jpeglib.h (libjpeg-turbo's headers) not found: install "
                                f"{JPEG_PACKAGES}, or set ECHO_NATIVE_JPEG_DIR to a "
                                "libjpeg-turbo prefix")
        if not ok:
            raise PlatformError(f"jpeglib.h does not compile with {cc[0]}: {why}")


class BuildExt(build_ext):
    """build_ext passing each source the flags of its language (setuptools has one list
    for every source of an extension), after checking that the build can succeed."""

    def finalize_options(self):
        super().finalize_options()
        # One compiler process per extension at once (-j): _kernel's 2 MB of generated C
        # takes most of a build, and the other three fit beside it on a second core.
        if self.parallel is None:
            self.parallel = len(os.sched_getaffinity(0))

    def build_extensions(self):
        check_build_requirements(self.compiler, self.extensions)
        compile_one = self.compiler._compile

        def _compile(obj, src, ext, cc_args, extra_postargs, pp_opts):
            extra = language_args[os.path.splitext(src)[1]]
            return compile_one(obj, src, ext, cc_args, list(extra_postargs) + extra, pp_opts)

        self.compiler._compile = _compile
        super().build_extensions()


def ext(name, sources, libraries=(), include_dirs=()):
    here = os.path.dirname(sources[0])
    # Headers and included sources: a change to any of them rebuilds the extension.
    depends = [os.path.join(d, f) for d in (here, *include_dirs) if os.path.isdir(d)
               for f in sorted(os.listdir(d)) if f.endswith((".h", ".cu"))]
    include_dirs = [here, *include_dirs, numpy.get_include()]
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
        depends=depends,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )


GENERATED = os.path.join("build", "generated")


def cuda_source_header():
    """Write kernels.cu, en_opcodes.h in place of its #include, as a C string into
    build/generated/en_kernels_source.h: the extension carries the exact text NVRTC
    compiles on a GPU (``_kernel.cuda_source()``), one definition for both devices."""
    with open(os.path.join("src", "kernel", "en_opcodes.h")) as f:
        opcodes = f.read()
    with open(os.path.join("src", "kernel", "kernels.cu")) as f:
        source = f.read().replace('#include "en_opcodes.h"', opcodes, 1)
    lines = "".join('"' + line.replace("\\", "\\\\").replace('"', '\\"') + '\\n"\n'
                    for line in source.split("\n"))
    text = ("/* Generated by setup.py from src/kernel/kernels.cu: do not edit. */\n"
            "static const char EN_KERNELS_SOURCE[] =\n" + lines + ";\n")
    os.makedirs(GENERATED, exist_ok=True)
    path = os.path.join(GENERATED, "en_kernels_source.h")
    try:
        with open(path) as f:
            if f.read() == text:
                return  # unchanged: keep its time stamp, no rebuild
    except OSError:
        pass
    with open(path, "w") as f:
        f.write(text)


cuda_source_header()

# en_seek.c compiles the kernel's en_jpeg.c into itself (its static stages plan and decode
# the sub-image exactly as a crop of the original): a change to it rebuilds _seek too.
# The decoder object those stages drive (en_decoder.c) is linked like the resampler.
SEEK = ext("echo_native._seek",
           ["src/seek/_seek.pyx", "src/seek/en_seek.c", "src/seek/en_transcode.c",
            "src/kernel/en_decoder.c", "src/kernel/en_resize.c", "src/kernel/en_augment.c"],
           libraries=["jpeg", "m"], include_dirs=["src/kernel"])
SEEK.depends.append(os.path.join("src", "kernel", "en_jpeg.c"))

EXTENSIONS = [
    ext(
        "echo_native._kernel",
        ["src/kernel/_kernel.pyx", "src/kernel/en_decoder.c", "src/kernel/en_jpeg.c",
         "src/kernel/en_resize.c", "src/kernel/en_augment.c", "src/kernel/en_ops.cpp",
         "src/kernel/en_pool.cpp"],
        libraries=["jpeg", "m"],
        # en_ops.cpp includes the CUDA kernels' source (one arithmetic for both devices)
        # and, as a string, the text NVRTC compiles (cuda_source_header).
        include_dirs=[GENERATED],
    ),
    ext("echo_native._ring", ["src/ring/_ring.pyx", "src/ring/en_ring.c"], ["rt"]),
    ext("echo_native._dlpack", ["src/dlpack/_dlpack.pyx"]),
    SEEK,
    ext("echo_native.lab._bench", ["src/bench/_bench.pyx", "src/bench/roi_ceiling.c"], ["jpeg"]),
]

# src/kernel on the include path: _seek.pyx includes the kernel's _kernel_args.pxi (the
# argument checks Decoder and Seeker share); "." is Cython's default, kept.
setup(ext_modules=cythonize(EXTENSIONS, compiler_directives=directives,
                            build_dir="build/cython", include_path=[".", "src/kernel"]),
      cmdclass={"build_ext": BuildExt})
