#!/usr/bin/env bash
# Every check of this project that needs a GPU, in one command (`make gpu-check`).
#
# Builds the extensions in place against the machine's own torch (no venv: a GPU image ships a
# CUDA torch, and `make venv` would install the CPU one), then runs the CUDA kernel tests
# (update and compression kernels), the CUDA end-to-end tests (compressed sums and the profile
# on a GPU included), the kernel bandwidth benchmark (float32, with the codec's stages, and
# bfloat16), the profiles of scaling.py's models (benchmarks/gpu_profiles.py, for
# scaling_measured.py), what a compression costs a compute-bound step, sapipe's host time per
# iteration (benchmarks/studies/host_overhead.py), and the compensation overhead of the
# full-size models. Logs and tables go to $GPU_OUT (default gpu-results/); the last lines
# printed are the summaries.
#
#   GPU_OUT=/some/dir PYTHON=python3 bash benchmarks/gpu_check.sh [quick|compression|compiled]
#
# `quick` skips the compensation-overhead run (the longest part, ~4 min on an H100).
# `compression` runs only what the compression needs checked: the build, the codec's CUDA
# kernels and compressed end-to-end tests, the codec's bandwidth, what a compression costs a
# compute-bound step, the 16-bit intake (benchmarks/studies/codec_intake.py) and sapipe's host
# time compressed. `compiled` runs the build, the compiled path (benchmarks/compiled.py) and
# sapipe's host time per iteration.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${GPU_OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} MAX_JOBS=${MAX_JOBS:-16}
# only the visible GPU's architecture (cpp_extension's own default too, made explicit)
arch=$($PY -c "import torch; c = torch.cuda.get_device_capability(); print(f'{c[0]}.{c[1]}')" 2>/dev/null) || {
  echo "gpu_check: torch sees no CUDA device" >&2; exit 1; }
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch}
status=0

echo "== build (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
$PY setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
$PY -c "from sapipe.kernels import _ext, ops; print('backends:', ops.backend('cuda'), ops.backend('cpu'), _ext.errors or '')"

# The CPU cases of the kernel tests run on every host; here the CUDA ones. The codec, the
# compressed sums and the profile first: the 63 mode cases of test_cuda take ~3 minutes.
echo "== tests"
$PY -m pytest -q -rs tests/unit/test_codec_kernels.py tests/gpu/test_cuda.py -k "codec or compressed or profile" \
  >"$OUT/tests_codec.log" 2>&1 || status=1
tail -3 "$OUT/tests_codec.log"
# What a compression costs a compute-bound step, and sapipe's host time per iteration
# (compressed too): run by the full check and by `compression`.
compression_cost() {
  echo "== what a compression costs a compute-bound step (one NCCL rank, full-size models)"
  $PY benchmarks/compensation_overhead.py --device cuda --size full --models gpt2,resnet50,vgg16 --modes none \
    --compressions bf16,int8 --fused-only --rounds 8 --out "$OUT/compression_cost_cuda.md" \
    >"$OUT/compression_cost.log" 2>&1 || status=1
  tail -12 "$OUT/compression_cost.log"
  echo "== backward's intake + a 16-bit sum's stage 1: via the float32 bucket, or cast on intake (full-size models)"
  $PY benchmarks/studies/codec_intake.py --device cuda --size full >"$OUT/codec_intake.md" 2>&1 || status=1
  tail -8 "$OUT/codec_intake.md"
  echo "== sapipe's host time per iteration, and DDP's (107 tiny layers, one NCCL rank: the step is the host's)"
  $PY benchmarks/studies/host_overhead.py --device cuda --compressions bf16,int8 >"$OUT/host_overhead.md" 2>&1 || status=1
  tail -8 "$OUT/host_overhead.md"
  echo "== the same, zero_grad(set_to_none=False): gradients accumulate into the buckets' views"
  $PY benchmarks/studies/host_overhead.py --device cuda --keep-grads >"$OUT/host_overhead_keep.md" 2>&1 || status=1
  tail -6 "$OUT/host_overhead_keep.md"
}
# The compiled path: eager and compiled sapipe beside compiled DDP, with graphs and breaks
# (benchmarks/compiled.py); run by the full check and by `compiled`.
compiled_path() {
  echo "== the compiled path (GPT small, bf16 autocast, inductor, one NCCL rank)"
  $PY benchmarks/compiled.py --device cuda --rounds 3 >"$OUT/compiled.md" 2>&1 || status=1
  tail -10 "$OUT/compiled.md"
}
if [ "${1:-}" = compiled ]; then
  compiled_path
  echo "== sapipe's host time per iteration, and DDP's (107 tiny layers, one NCCL rank)"
  $PY benchmarks/studies/host_overhead.py --device cuda >"$OUT/host_overhead.md" 2>&1 || status=1
  tail -8 "$OUT/host_overhead.md"
  exit $status
fi
if [ "${1:-}" = compression ]; then
  echo "== the codec's bandwidth"
  $PY benchmarks/kernels.py --device cuda --only codec >"$OUT/kernels_codec.md" 2>&1 || status=1
  compression_cost
  cat "$OUT/kernels_codec.md"
  exit $status
fi
$PY -m pytest -q -rs tests/unit/test_kernels.py tests/unit/test_library.py -k cuda >"$OUT/tests_kernels.log" 2>&1 || status=1
tail -1 "$OUT/tests_kernels.log"
$PY -m pytest -q -rs tests/gpu/test_cuda.py -k "not compressed and not profile" >"$OUT/tests_modes.log" 2>&1 || status=1
tail -1 "$OUT/tests_modes.log"

echo "== kernel bandwidth"
$PY benchmarks/kernels.py --device cuda >"$OUT/kernels_f32.md" 2>&1 || status=1
$PY benchmarks/kernels.py --device cuda --dtype bfloat16 --n 33554432 >"$OUT/kernels_bf16.md" 2>&1 \
  || status=1

echo "== profiles of scaling.py's models (one NCCL rank, fp32 and amp)"
$PY benchmarks/gpu_profiles.py --out "$OUT/profiles" >"$OUT/profiles.log" 2>&1 || status=1
tail -10 "$OUT/profiles.log"

compression_cost
compiled_path

if [ "${1:-}" != quick ]; then
  echo "== compensation overhead (full-size models, one NCCL rank)"
  $PY benchmarks/compensation_overhead.py --device cuda --size full --models gpt2,resnet50,vgg16 \
    --rounds 8 --out "$OUT/compensation_overhead_cuda.md" >"$OUT/compensation_overhead.log" 2>&1 || status=1
  tail -18 "$OUT/compensation_overhead.log"
fi
cat "$OUT/kernels_f32.md" "$OUT/kernels_bf16.md"
exit $status
