"""sapipe's staleness for a DDP model: ``ddp.register_comm_hook(sapipe.StaleHook(...),
sapipe.stale_hook)`` (sapipe/ddp_hook.py), on 2 Gloo ranks.

* stale_layers=0 trains exactly as plain DDP (within 1e-6: the hook's division and DDP's
  own may round apart);
* stale_layers=k > 0 trains as sapipe's optimizer path with ``compensation="none"`` at the
  same k, within 1e-6, whether DDP gives each parameter a bucket or puts them all in one
  (stale and synchronous parameters mixed), with plain SGD (the one optimizer for which the
  zeros DDP's first stale step must apply equal the optimizer path's skipped update);
* its state saved mid-run and loaded into a fresh job continues bit-identically.
"""

# no `from __future__ import annotations`: DDP checks a hook's annotations as objects
import pytest
import torch
import torch.distributed as dist
from support.dist_utils import run_ranks
from support.models import loss_fn_for, make_batches, make_model
from support.training import named_weights

STEPS = 8
K = 2  # of the MLP's 3 Linear layers


def _ddp(k, optimizer="adamw", bucket_cap_mb=0.0001, compression=None):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sapipe

    model = make_model("mlp", seed=0)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)  # tiny: a bucket per parameter
    if k is not None:
        state = sapipe.StaleHook(ddp, stale_layers=k, compression=compression)
        ddp.register_comm_hook(state, sapipe.stale_hook)
    elif compression is not None:  # torch's own hook: the peer of the same compression
        # (its public bf16 hook insists on NCCL; the cast-and-sum it wraps is the same for both)
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[compression]

        def cast_and_sum(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            return default_hooks._compress_hook(dtype, state, bucket)

        ddp.register_comm_hook(None, cast_and_sum)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, ddp, opt


def _train(ddp, opt, rank, batches):
    for x, y in (batch[rank] for batch in batches):
        opt.zero_grad()
        loss_fn_for("mlp")(ddp(x), y).backward()
        opt.step()


def _plain_vs_hooked(rank, world_size, optimizer, k, bucket_cap_mb=0.0001, compression=None):
    batches = make_batches("mlp", STEPS, world_size)
    out = {}
    for name, hook_k in (("plain", None), ("hooked", k)):
        model, ddp, opt = _ddp(hook_k, optimizer, bucket_cap_mb, compression)
        _train(ddp, opt, rank, batches)
        out[name] = named_weights(model)
    return out


def _optimizer_path(rank, world_size, k):
    import sapipe

    model = make_model("mlp", seed=0)
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        stale_layers=k,
        compensation="none",
        bucket_cap_mb=0.0001,
    )
    _train(model, opt, rank, make_batches("mlp", STEPS, world_size))
    with opt.real_weights():
        weights = named_weights(model)
    opt.close()
    return weights


@pytest.mark.parametrize("compression", [None, "fp16", "bf16"])
def test_no_stale_layers_is_plain_ddp(compression):
    """With a compression, plain DDP is DDP with torch's own hook of that compression."""
    args = ("adamw", 0, 0.0001, compression)
    for result in run_ranks(_plain_vs_hooked, world_size=2, args=args):
        for name, value in result["plain"].items():
            assert abs(result["hooked"][name] - value).max() <= 1e-6, name


def _int8(rank, world_size):
    import sapipe

    _, ddp, _ = _ddp(None)
    try:
        sapipe.StaleHook(ddp, stale_layers=1, compression="int8")
    except sapipe.ConfigurationError as exc:
        return str(exc)
    return None


def test_int8_is_refused_naming_the_optimizer_path():
    for message in run_ranks(_int8, world_size=2):
        assert message is not None and "DistributedOptimizer(compression=...)" in message


@pytest.mark.parametrize(
    "bucket_cap_mb", [0.0001, 25.0], ids=["bucket per parameter", "one bucket"]
)
def test_stale_layers_follow_the_optimizer_path(bucket_cap_mb):
    hooked = run_ranks(_plain_vs_hooked, world_size=2, args=("sgd", K, bucket_cap_mb))
    path = run_ranks(_optimizer_path, world_size=2, args=(K,))
    for rank in range(2):
        moved = max(abs(hooked[rank]["plain"][n] - v).max() for n, v in path[rank].items())
        assert moved > 1e-4, "staleness must change the result (else this test proves nothing)"
        for name, value in path[rank].items():
            assert abs(hooked[rank]["hooked"][name] - value).max() <= 1e-6, name


def _resumed(rank, world_size, directory):
    import sapipe

    batches = make_batches("mlp", STEPS, world_size)
    model, ddp, opt = _ddp(K)
    _train(ddp, opt, rank, batches)
    uninterrupted = named_weights(model)

    model, ddp, opt = _ddp(None)
    hook = sapipe.StaleHook(ddp, stale_layers=K)
    ddp.register_comm_hook(hook, sapipe.stale_hook)
    _train(ddp, opt, rank, batches[: STEPS // 2])
    saved = {
        "model": model.state_dict(),
        "opt": opt.state_dict(),
        "hook": hook.state_dict(),
    }
    torch.save(saved, f"{directory}/hook-{rank}.pt")

    model, ddp, opt = _ddp(None)
    hook = sapipe.StaleHook(ddp, stale_layers=K)
    ddp.register_comm_hook(hook, sapipe.stale_hook)
    loaded = torch.load(f"{directory}/hook-{rank}.pt", weights_only=False)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["opt"])
    hook.load_state_dict(loaded["hook"])
    _train(ddp, opt, rank, batches[STEPS // 2 :])
    return uninterrupted, named_weights(model)


def test_its_state_resumes_bit_identically(tmp_path):
    for uninterrupted, resumed in run_ranks(_resumed, world_size=2, args=(str(tmp_path),)):
        for name, value in uninterrupted.items():
            assert (resumed[name] == value).all(), name


def _bad_k(rank, world_size, k):
    import sapipe

    _, ddp, _ = _ddp(None)
    try:
        sapipe.StaleHook(ddp, stale_layers=k)
    except sapipe.ConfigurationError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("k", [-1, 4, "2"])
def test_a_bad_stale_layers_is_refused(k):
    for message in run_ranks(_bad_k, world_size=2, args=(k,)):
        assert message is not None and "stale_layers must be an int from 0 to" in message
