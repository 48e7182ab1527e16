"""Packaging for sapipe.

Install (torch first, so pip never resolves torch itself):

    pip install torch==2.13.0
    pip install --no-build-isolation -e .

`make venv` does exactly this.
"""
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


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
# torch.utils.cpp_extension needs torch at build time, which is why the package is installed
# with --no-build-isolation (torch must never be a build-system requirement: pip would
# resolve and download CUDA wheels). sapipe/ops.py falls back to pure PyTorch when an
# extension is absent (one warning).
# ---------------------------------------------------------------------------
def _extensions():
    if os.environ.get("SAPIPE_NO_EXT", "") not in ("", "0"):
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:  # torch not installed yet: build the pure-Python package
        return [], {}
    import glob
    import sys

    def rel(pattern):
        return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", pattern)))

    cxx = ["-O3", "-g0", "-fno-math-errno"]
    link = []
    if sys.platform.startswith("linux"):
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    cuda_only = {"csrc/cuda_bindings.cpp"}
    exts = [
        cpp_extension.CppExtension(
            "sapipe._C",
            [s for s in rel("*.cpp") if s not in cuda_only],
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
                sorted(cuda_only) + rel("*.cu"),
                extra_compile_args={"cxx": ["-O3", "-g0"], "nvcc": ["-O3"]},
            )
        except (OSError, RuntimeError) as exc:  # e.g. no CUDA toolkit found
            print(f"sapipe: WARNING: not building sapipe._C_cuda ({exc})", file=sys.stderr)
        else:
            cuda_ext.sapipe_optional = True
            exts.append(cuda_ext)

    class BuildExt(cpp_extension.BuildExtension):
        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001 - optional extension only
                if not getattr(ext, "sapipe_optional", False):
                    raise
                ext.sapipe_failed = True
                print(f"sapipe: WARNING: optional extension {ext.name} failed to build "
                      f"({exc}); CUDA tensors will use the pure-PyTorch kernels", file=sys.stderr)

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
