"""sapipe on a CUDA device, end to end: the engine, its CUDA kernels and streams, and NCCL.

The same configurations as ``test_modes`` -- every staleness and compensation mode, SGD,
Adam and AdamW, in float64 -- held to the same independent float64 reference (rtol 1e-9),
with the model on the GPU:

* two Gloo ranks sharing the one GPU (Gloo all-reduces CUDA tensors; NCCL refuses two
  ranks on one device), once through the default back-end and once through push-pull,
  whose worker runs its collectives on a CUDA side stream;
* one NCCL rank, so the NCCL code path (device-side waits, no host blocking) runs too.

Every test skips without a GPU (CI has none); the kernels' own tests are in test_kernels.
"""
from __future__ import annotations

import functools

import pytest
import torch

from dist_utils import run_ranks
from test_modes import CONFIGS, _train, check_against_reference, config_id

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

# synchronous; stale without compensation; DC outer and diagonal; each weight prediction;
# Pipe-SGD with s = 2 (the double-buffered slots at depth 3)
CUDA_CONFIGS = [CONFIGS[i] for i in (0, 2, 4, 5, 7, 8, 9, 10, 16)]
PUSHPULL = {"backend": "pushpull", "partition_mb": 13 * 8 / 2**20}  # odd chunks, padded tails


def _on_cuda(rank: int, world_size: int, kind: str, configs, options=None):
    from sapipe import _ext, ops

    # the fused CUDA kernels must be what runs, not the pure-PyTorch fallback
    assert ops.backend("cuda") == "cuda-ext", _ext.errors.get("_C_cuda")
    return _train(rank, world_size, kind, configs, options, device="cuda")


@functools.lru_cache(maxsize=None)
def _results(kind: str, ranks: int, backend: str, options_key: str):
    options = PUSHPULL if options_key == "pushpull" else None
    return run_ranks(_on_cuda, world_size=ranks, args=(kind, CUDA_CONFIGS, options),
                     timeout=300, backend=backend)


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
