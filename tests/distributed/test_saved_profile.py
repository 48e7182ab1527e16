"""opt.save_profile(): what ``stale_layers="auto"`` measured, written and read back intact, and
files that are not a profile of this model refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from support.dist_utils import run_ranks
from support.models import loss_fn_for, make_batches, make_model

from sapipe.errors import ConfigurationError
from sapipe.schedule.saved_profile import FORMAT, SavedProfile


def _profiled(rank, world_size, path):
    import sapipe
    from sapipe.errors import UsageError

    model = make_model("tied", seed=0, dtype=torch.float64)
    fixed = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), model, stale_layers=1
    )
    with pytest.raises(UsageError, match="needs stale_layers='auto'"):
        fixed.save_profile(path)
    fixed.close()
    model = make_model("tied", seed=0, dtype=torch.float64)
    opt = sapipe.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        model,
        stale_layers="auto",
        profile_steps=2,
        tune_steps=0,
        bucket_cap_mb=0.0008,
        timeout=60,
    )
    batches = make_batches("tied", 12, world_size, dtype=torch.float64)
    for t in range(12):
        if t == 1:
            with pytest.raises(UsageError, match="not decided"):
                opt.save_profile(path)
        x, y = batches[t][rank]
        opt.zero_grad()
        loss_fn_for("tied")(model(x), y).backward()
        opt.step()
    assert opt.stale_layers != "auto"
    if rank == 0:
        opt.save_profile(path)
    prof = opt.auto.profile
    out = {
        "layers": [layer.name for layer in opt.layers],
        "numel": [layer.numel for layer in opt.layers],
        "forward": prof.forward,
        "beta": prof.beta,
        "k": opt.decision.k,
        "predicted": opt.decision.iteration_time,
        "cap": opt.settings.bucket_cap_bytes,
    }
    opt.close()
    return out


def test_a_saved_profile_holds_what_auto_decided_from(tmp_path):
    path = str(tmp_path / "profile.json")
    out = run_ranks(_profiled, world_size=2, args=(path,))[0]
    saved = SavedProfile.load(path)
    assert list(saved.layers) == out["layers"] and list(saved.numel) == out["numel"]
    assert list(saved.forward) == out["forward"] and saved.beta == out["beta"]
    assert saved.stale_layers == out["k"] and saved.iteration_time == out["predicted"]
    assert (saved.world_size, saved.nodes, saved.ranks_per_node, saved.hierarchical) == (
        2,
        1,
        2,
        False,
    )
    assert (
        saved.element_size == 8 and saved.bucket_cap_bytes == out["cap"] and saved.device == "cpu"
    )
    assert (saved.compression, saved.wire_ratio, saved.codec_per_byte) == (None, 1.0, 0.0)
    saved.check_model(out["layers"], out["numel"])
    with pytest.raises(
        ConfigurationError, match=r"another model: its layer 1 is '.*' \(\d+ parameters\)"
    ):
        saved.check_model(out["layers"][:1] + ["other"] + out["layers"][2:], out["numel"])
    with pytest.raises(
        ConfigurationError, match=f"another model: it has {len(out['layers'])} layers, the model 2"
    ):
        saved.check_model(out["layers"][:2], out["numel"][:2])


def _a_profile(**changes) -> dict:
    data = dict(
        format=FORMAT,
        layers=["a", "b"],
        numel=[10, 20],
        element_size=4,
        forward=[1e-3, 2e-3],
        backward=[2e-3, 4e-3],
        step_time=1e-4,
        update_time=1e-4,
        alpha=1e-5,
        beta=1e-9,
        slowdown=0.0,
        world_size=4,
        nodes=2,
        ranks_per_node=2,
        hierarchical=True,
        backend="torch",
        compression=None,
        wire_ratio=1.0,
        codec_per_byte=0.0,
        bucket_cap_bytes=1 << 20,
        sync_at_step=False,
        device="cpu",
        stale_layers=1,
        iteration_time=9e-3,
    )
    data.update(changes)
    return data


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"format": "other/2"}, "not a sapipe profile"),
        ({"forward": [1e-3]}, "inconsistent: 2 layers, 2 sizes, 1 forward"),
        ({"beta": -1.0}, "negative or non-finite"),
        ({"step_time": float("nan")}, "negative or non-finite"),
        ({"nodes": 5}, "inconsistent: 4 ranks on 5 node"),
    ],
)
def test_a_file_that_is_not_a_valid_profile_is_refused_by_name(tmp_path, changes, message):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_a_profile(**changes)))
    with pytest.raises(ConfigurationError, match=message):
        SavedProfile.load(str(path))


def test_missing_fields_and_unreadable_files_are_named(tmp_path):
    data = _a_profile()
    del data["alpha"]
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(ConfigurationError, match="lacks alpha"):
        SavedProfile.load(str(tmp_path / "p.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigurationError, match="cannot read the profile"):
        SavedProfile.load(str(tmp_path / "bad.json"))
    round_trip = SavedProfile.from_dict(_a_profile())
    assert SavedProfile.from_dict(json.loads(json.dumps(round_trip.to_dict()))) == round_trip
