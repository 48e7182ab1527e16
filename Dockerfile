# sapipe for GPU clusters: CUDA PyTorch + sapipe with its C++/CUDA kernels built, and
# `sapipe-launch` (torchrun + --emulate-net + BytePS-style env) as the entry point.
#
#   docker build -t sapipe .
#   docker run --gpus all --ipc=host --rm -v $PWD:/workspace sapipe \
#       --standalone --nproc-per-node=gpu train.py
#
# Multi-node: add --network=host (NCCL talks between hosts) and the usual torchrun flags,
# or the DMLC_* variables of a BytePS job spec. --emulate-net creates a network namespace
# and shapes its loopback: run with --cap-add=SYS_ADMIN --cap-add=NET_ADMIN (or --privileged).
#
# The base image's CUDA must be 12.x for V100 (sm_70): CUDA 13 and torch's cu128/cu129
# builds dropped Volta. Override with --build-arg BASE_IMAGE=... / TORCH_CUDA_ARCH_LIST=...
ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.6-cudnn9-devel
FROM ${BASE_IMAGE}

# iproute2 (ip, tc) and util-linux (unshare) for --emulate-net; a C++ toolchain and ninja
# for the extension build (usually in the devel image already).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        iproute2 util-linux build-essential ninja-build \
 && rm -rf /var/lib/apt/lists/*

# V100, A100, H100. There is no GPU at build time, so setup.py decides from torch.version.cuda
# + CUDA_HOME; SAPIPE_CUDA_EXT=1 insists on the CUDA kernels.
ARG TORCH_CUDA_ARCH_LIST="7.0;8.0;9.0"
ENV TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    CUDA_HOME=/usr/local/cuda \
    SAPIPE_CUDA_EXT=1 \
    MAX_JOBS=8

WORKDIR /opt/sapipe
COPY . .
# --no-build-isolation: build against the image's torch (never let pip resolve torch).
# The import check fails the image build if either compiled module is missing (setup.py
# only warns when the optional CUDA build fails).
RUN pip install --no-cache-dir --no-build-isolation -e . \
 && python -c "import torch, sapipe, sapipe._C, sapipe._C_cuda; \
print('sapipe', sapipe.__version__, 'torch', torch.__version__, 'CUDA', torch.version.cuda)" \
 && sapipe-launch --dry-run --standalone train.py

WORKDIR /workspace
ENTRYPOINT ["sapipe-launch"]
CMD ["--help"]
