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
# C++ / CUDA extension (csrc/) -- NOT BUILT YET (later issue).
#
# The fused DC / WP / optimizer kernels will be built here with
# torch.utils.cpp_extension, roughly:
#
#   from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
#   ext_modules = [CppExtension("sapipe._C", sources=[...csrc/*.cpp...])]
#   (CUDAExtension when CUDA is available / requested)
#   cmdclass = {"build_ext": BuildExtension}
#
# That import needs torch at build time, which is why the package is installed
# with --no-build-isolation (torch must never be a build-system requirement:
# pip would resolve and download CUDA wheels). sapipe/ops.py falls back to
# pure PyTorch when the extension is absent.
# ---------------------------------------------------------------------------
ext_modules = []
cmdclass = {}

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
    # Console script `sapipe-launch` (launcher/): later issue, not declared yet.
    # entry_points={"console_scripts": ["sapipe-launch = ...:main"]},
    zip_safe=False,
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
