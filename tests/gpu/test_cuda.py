"""sapipe on a CUDA device, end to end: the engine, its CUDA kernels and streams, and NCCL.

The same configurations as ``test_modes`` -- every staleness and compensation mode, SGD,
Adam and AdamW, in float64 -- held to the same independent float64 reference (rtol 1e-9),
with the model on the GPU:

* two Gloo ranks sharing the one GPU (Gloo all-reduces CUDA tensors; NCCL refuses two
  ranks on one device), once through the default back-end and once through push-pull,
  whose worker runs its collectives on a CUDA side stream;
* one NCCL rank, so the NCCL code path (device-side waits, no host blocking) runs too;
* compressed sums (test_compression's configurations, float64) through the CUDA codec
  kernels, on two Gloo ranks and on one NCCL rank, against the same reference;
* the scheduler's profile of a model on the GPU: per-layer times are the GPU's, not the
  times at which the host queued the layers' kernels.

Every test skips without a GPU (CI has none); the kernels' own tests are in test_kernels.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
from support import compressed
from support.dist_utils import run_ranks
from support.modes import CONFIGS, check_against_reference, config_id, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

# synchronous; stale without compensation; DC outer and diagonal; each weight prediction;
# Pipe-SGD with s = 2 (the double-buffered slots at depth 3)
CUDA_CONFIGS = [CONFIGS[i] for i in (0, 2, 4, 5, 7, 8, 9, 10, 16)]
PUSHPULL = {"backend": "pushpull", "partition_mb": 13 * 8 / 2**20}  # odd chunks, padded tails


def _on_cuda(rank: int, world_size: int, kind: str, configs, options=None):
    from sapipe.kernels import _ext, ops

    # the fused CUDA kernels must be what runs, not the pure-PyTorch fallback
    assert ops.backend("cuda") == "cuda-ext", _ext.errors.get("_C_cuda")
    return train(rank, world_size, kind, configs, options, device="cuda")


@functools.cache
def _results(kind: str, ranks: int, backend: str, options_key: str):
    options = PUSHPULL if options_key == "pushpull" else None
    return run_ranks(
        _on_cuda, world_size=ranks, args=(kind, CUDA_CONFIGS, options), timeout=300, backend=backend
    )


def _check(kind, config, ranks, backend, options_key):
    per_rank = _results(kind, ranks, backend, options_key)
    index = CUDA_CONFIGS.index(config)
    check_against_reference(kind, config, [per_rank[r][index] for r in range(ranks)])


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("config", CUDA_CONFIGS, ids=config_id)
def test_gloo_ranks_on_cuda_match_reference(kind, config):
    _check(kind, config, 2, "gloo", "")


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("config", CUDA_CONFIGS, ids=config_id)
def test_pushpull_on_cuda_matches_reference(kind, config):
    _check(kind, config, 2, "gloo", "pushpull")


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("config", CUDA_CONFIGS, ids=config_id)
def test_nccl_rank_matches_reference(kind, config):
    _check(kind, config, 1, "nccl", "")


# ------------------------------------------------------------------ compression on CUDA

# the codec's CUDA kernels
COMPRESSED = [c for c in compressed.CONFIGS if c[1] != 0 or c[0] == "int8"]


def _compressed_on_cuda(rank: int, world_size: int, configs):
    from sapipe.kernels import _ext
    from sapipe.kernels import codec as codec_kernels

    assert codec_kernels._compiled(torch.device("cuda"), torch.float64), _ext.errors.get("_C_cuda")
    return compressed.train(rank, world_size, configs, device="cuda")


@functools.cache
def _compressed_results(ranks: int, backend: str):
    return run_ranks(
        _compressed_on_cuda, world_size=ranks, args=(COMPRESSED,), timeout=300, backend=backend
    )


@pytest.mark.parametrize("ranks,backend", [(2, "gloo"), (1, "nccl")], ids=["2-gloo", "1-nccl"])
@pytest.mark.parametrize("config", COMPRESSED, ids=compressed.config_id)
def test_compressed_sums_on_cuda_match_reference(config, ranks, backend):
    """The CUDA codec kernels (float64) inside the whole engine, against the same float64
    reference as on the CPU: Gloo's all-to-all and all-gather of CUDA bytes, and NCCL's."""
    per_rank = _compressed_results(ranks, backend)
    compressed.check_against_reference(config, [run[COMPRESSED.index(config)] for run in per_rank])


# ------------------------------------------------------------------ the profile on a GPU

WIDTH, ROWS, HOST_OPS = 8192, 4096, 60


class _HostHeavy(torch.nn.Module):
    """Cheap on the GPU, costly to queue: a scale, then many tiny kernels on one element."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(WIDTH))

    def forward(self, x):
        x = x * self.scale
        tiny = x[:1, :1]
        for _ in range(HOST_OPS):
            tiny = tiny * 1.0 + 0.0
        return x + 0.0 * tiny


def _profile_on_gpu(rank: int, world_size: int):
    import sapipe

    torch.manual_seed(0)
    model = torch.nn.Sequential(_HostHeavy(), torch.nn.Linear(WIDTH, WIDTH), _HostHeavy()).cuda()
    x = torch.randn(ROWS, WIDTH, device="cuda")

    def iteration():
        model(x).square().mean().backward()

    times = []  # forward + backward alone, without sapipe, each timed by the GPU finishing it
    for _ in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        iteration()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        model.zero_grad()
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-6), model, stale_layers="auto"
    )
    for _ in range(40):
        opt.zero_grad()
        iteration()
        opt.step()
        if opt.auto.decided:
            break
    profile = opt.auto.profile
    opt.close()
    return profile.forward, profile.backward, sorted(times)[len(times) // 2]


def test_profile_times_layers_as_the_gpu_runs_them():
    """The middle layer does almost all of the GPU's work and the outer two almost all of the
    host's queueing: a profile of host queueing times would give the middle layer a small
    fraction of each outer one's time. Measured as the GPU runs it, it takes several times
    each, in forward and in backward, and the profiled forward + backward is the one timed
    without sapipe within 20%.

    Not a share near 1: a profiled iteration waits for the GPU at every layer boundary, so a
    layer's kernels are queued only once the layer before it has run, and an outer layer
    costs its own queueing (2 ms each on an H200, against 11 ms of the middle layer)."""
    ((forward, backward, alone),) = run_ranks(
        _profile_on_gpu, world_size=1, timeout=300, backend="nccl"
    )
    for phase in (forward, backward):
        assert phase[1] >= 3 * max(phase[0], phase[2]), (forward, backward)
    assert sum(forward) + sum(backward) == pytest.approx(alone, rel=0.2), (forward, backward, alone)
