"""Packaging for sapipe.

Install torch first (so pip never resolves torch itself), then sapipe, which compiles its
kernels (csrc/) against that torch:

    pip install torch==2.13.0
    pip install --no-build-isolation .        # or -e . ; plain `pip install .` works too

`make venv` does this (editable). The build goes through the in-tree PEP 517 backend
build_backend/sapipe_build.py, which lets pip's isolated build see the installed torch and
fails with instructions when there is none; SAPIPE_NO_EXT=1 builds without kernels.
"""

import os
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "build_backend"))
import sapipe_build  # noqa: E402  (the in-tree PEP 517 backend: SAPIPE_NO_EXT, the torch message)


def _long_description():
    path = os.path.join(HERE, "README.md")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return ""


# ---------------------------------------------------------------------------
# C++ / CUDA extension (csrc/): fused DC / WP-peek / SGD / Adam(W) kernels.
#
#   sapipe._C       C++ CPU kernels (-O3 -fopenmp), always built (needs torch + a C++20
#                   compiler at build time; SAPIPE_NO_EXT=1 skips it).
#   sapipe._C_cuda  CUDA kernels, built only when torch has CUDA (torch.cuda.is_available(),
#                   or torch.version.cuda and CUDA_HOME; SAPIPE_CUDA_EXT=0/1 overrides);
#                   optional: a failed CUDA build is reported and skipped, the CUDA path
#                   then runs in pure PyTorch.
#
# torch.utils.cpp_extension needs torch at build time, and torch must never be a
# build-system requirement (pip would resolve and download CUDA wheels and build against
# those). build_backend/sapipe_build.py makes pip's isolated build see the installed torch;
# without torch (and without SAPIPE_NO_EXT=1) the build FAILS with instructions rather than
# silently installing no kernels. sapipe/kernels/ops.py falls back to pure PyTorch when an extension
# is absent (one warning). The sdist carries every csrc file (MANIFEST.in).
# ---------------------------------------------------------------------------
#: csrc/ and its folders: shared headers, the operator schemas (library.cpp) and sapipe._C's
#: Python module at the top; cpu/ (the CPU update kernels and their registration), codec/ (the
#: compression codec's CPU and CUDA kernels), cuda/ (the CUDA update kernels and sapipe._C_cuda,
#: which registers them), runtime/ (the gradient intake's autograd hooks, in sapipe._C).
#: Every folder is on the include path, so a source includes any header by its file name.
CSRC_DIRS = ["csrc", "csrc/cpu", "csrc/codec", "csrc/cuda", "csrc/runtime"]


def _csrc(pattern):
    import glob

    return sorted(
        os.path.relpath(p, HERE)
        for d in CSRC_DIRS
        for p in glob.glob(os.path.join(HERE, d, pattern))
    )


def _no_torch(why):
    """sapipe._C as a placeholder whose build fails with the install instructions (an sdist
    or metadata build still works without torch; build_ext does not)."""
    message = sapipe_build.missing_torch(why)

    class NoTorchBuildExt(build_ext):
        def run(self):
            raise SystemExit(message)

    cuda_only = {"csrc/cuda/cuda_library.cpp"}
    ext = Extension("sapipe._C", [s for s in _csrc("*.cpp") if s not in cuda_only])
    return [ext], {"build_ext": NoTorchBuildExt}


def _extensions():
    if sapipe_build.ext_disabled():
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        return _no_torch(f"{type(exc).__name__}: {exc}")

    cxx = ["-O3", "-g0", "-fno-math-errno"]
    link = []
    if sys.platform.startswith("linux"):
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    cuda_only = {"csrc/cuda/cuda_library.cpp"}
    exts = [
        cpp_extension.CppExtension(
            "sapipe._C",
            [s for s in _csrc("*.cpp") if s not in cuda_only],
            include_dirs=[os.path.join(HERE, d) for d in CSRC_DIRS],
            extra_compile_args={"cxx": cxx},
            extra_link_args=link,
        )
    ]
    # SAPIPE_CUDA_EXT: unset = auto (as above), 0 = never, 1 = try even without CUDA torch
    cuda_env = os.environ.get("SAPIPE_CUDA_EXT", "")
    want_cuda = cuda_env == "1" or (
        cuda_env != "0"
        and (torch.cuda.is_available() or (torch.version.cuda and cpp_extension.CUDA_HOME))
    )
    if want_cuda:
        try:
            cuda_ext = cpp_extension.CUDAExtension(
                "sapipe._C_cuda",
                sorted(cuda_only) + _csrc("*.cu"),
                include_dirs=[os.path.join(HERE, d) for d in CSRC_DIRS],
                extra_compile_args={"cxx": ["-O3", "-g0"], "nvcc": ["-O3"]},
            )
        except (OSError, RuntimeError) as exc:  # e.g. no CUDA toolkit found
            print(f"sapipe: WARNING: not building sapipe._C_cuda ({exc})", file=sys.stderr)
        else:
            cuda_ext.sapipe_optional = True
            exts.append(cuda_ext)

    def explain(name, exc):
        print(
            f"sapipe: ERROR: building {name} against torch {torch.__version__} "
            f"failed ({exc}). It needs a C++20 compiler (g++ >= 10 or clang; $CC / $CXX, if set, "
            "must name one); `SAPIPE_NO_EXT=1 pip install .` installs sapipe without compiled "
            "kernels (pure-PyTorch kernels).",
            file=sys.stderr,
        )

    class BuildExt(cpp_extension.BuildExtension):
        def build_extensions(self):
            try:  # torch checks the compiler first, for all extensions at once
                super().build_extensions()
            except Exception as exc:  # noqa: BLE001 - re-raised
                if not getattr(exc, "sapipe_explained", False):
                    explain("sapipe's kernels", exc)
                raise

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001 - re-raised unless optional
                if not getattr(ext, "sapipe_optional", False):
                    explain(ext.name, exc)
                    exc.sapipe_explained = True
                    raise
                ext.sapipe_failed = True
                print(
                    f"sapipe: WARNING: optional extension {ext.name} failed to build "
                    f"({exc}); CUDA tensors will use the pure-PyTorch kernels",
                    file=sys.stderr,
                )

        def copy_extensions_to_source(self):
            # an editable / --inplace build copies every extension back into the source
            # tree; one that failed to build (above) has nothing to copy
            built = [e for e in self.extensions if not getattr(e, "sapipe_failed", False)]
            self.extensions, everything = built, self.extensions
            try:
                super().copy_extensions_to_source()
            finally:
                self.extensions = everything

    return exts, {"build_ext": BuildExt}


ext_modules, cmdclass = _extensions()

setup(
    name="sapipe",
    version="0.1.0",
    description="Staleness-aware pipelined gradient synchronisation for PyTorch "
    "data-parallel training (SAPipe)",
    long_description=_long_description(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["sapipe", "sapipe.*"]),
    install_requires=[
        "torch>=2.1",  # unpinned on purpose: satisfied by the torch already installed
        "numpy",
    ],
    extras_require={"dev": ["pytest"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    # `sapipe-launch`: torchrun + --emulate-net + BytePS-style env (sapipe/launch/main.py)
    entry_points={"console_scripts": ["sapipe-launch = sapipe.launch.main:main"]},
    zip_safe=False,
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
