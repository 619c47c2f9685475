"""Checkpoints load with weights_only=True: a planted pickle is refused and its payload never runs.

Each test plants a pickle whose ``__reduce__`` would create a marker directory, in a single-file
checkpoint, in a sharded checkpoint's trainer state, in its DCP ``.metadata`` and in a DCP non-tensor
item, and asserts the load raises :class:`UnsafeCheckpointError` and the marker does not exist. The
sharded checkpoints are written and read by ``torch.distributed.checkpoint`` without a process group.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import warnings
from pathlib import Path

import pytest
import torch

from cp_attention.training.checkpoint import (
    UnsafeCheckpointError,
    checkpoint_info,
    find_complete_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from cp_attention.training.config import optimizer
from cp_attention.training.sharded_checkpoint import TRAINER_STATE, load_sharded_checkpoint


class Plant:
    """Unpickled unsafely, creates ``marker``: what a malicious checkpoint would do, harmlessly."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt, sched = optimizer(model.parameters(), {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1,
                                                "betas": [0.9, 0.95], "warmup_steps": 2}, 10)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def _trainer_state(sched) -> dict:
    """What cp_attention.training.loop saves besides model and optimizer: every field's type."""
    return {"step": 1, "scheduler": sched.state_dict(), "data": {"generator": torch.Generator().get_state()},
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}


def test_the_training_loops_state_loads_weights_only(tmp_path):
    model, opt, sched = _model_and_opt()
    cfg = {"cp_size": 2, "trainer": {"steps": 10, "grad_clip": None}, "optim": {"betas": [0.9, 0.95]}}
    state = {**_trainer_state(sched), "model": model.state_dict(), "optimizer": opt.state_dict(), "config": cfg,
             "world_size": 2}
    save_checkpoint(tmp_path, 1, state)
    got = load_checkpoint(tmp_path)
    assert got["rng"]["python"] == state["rng"]["python"]
    assert torch.equal(got["rng"]["torch"], state["rng"]["torch"]) and got["config"] == cfg
    assert got["scheduler"] == sched.state_dict()
    fresh, fresh_opt, _ = _model_and_opt()
    fresh_opt.load_state_dict(got["optimizer"])
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_a_planted_pickle_in_a_checkpoint_is_refused_unrun(tmp_path):
    marker = tmp_path / "payload_ran"
    save_checkpoint(tmp_path / "ckpt", 2, {"step": 2, "w": torch.ones(2)})
    save_checkpoint(tmp_path / "ckpt", 4, {"step": 4, "w": torch.ones(2), "evil": Plant(marker)})
    with pytest.raises(UnsafeCheckpointError, match=r"step_0000004\.pt' holds an object that is not a tensor or a "
                                                    r"plain Python type \(.*mkdir.*\), and was not loaded") as e:
        load_checkpoint(tmp_path / "ckpt")  # the manifest matches: whoever planted it rewrote that too
    assert "delete it, or resume from another checkpoint" in str(e.value)
    assert not marker.exists()
    # without a manifest (an old checkpoint) info loads it to check it: refused too, and auto skips it
    (tmp_path / "ckpt" / "step_0000004.pt.json").unlink()
    with pytest.raises(UnsafeCheckpointError):
        checkpoint_info(tmp_path / "ckpt" / "step_0000004.pt")
    path, info, skipped = find_complete_checkpoint(tmp_path / "ckpt")
    assert path.name == "step_0000002.pt" and info["step"] == 2 and "holds an object" in skipped[0]
    assert not marker.exists()
    # the plant is real: an unsafe load runs it
    torch.load(tmp_path / "ckpt" / "step_0000004.pt", weights_only=False)
    assert marker.exists()


def _sharded(tmp_path: Path, optim_state_edit=None) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, sched = _model_and_opt()
    model_state, optim_state = get_state_dict(model, opt)
    if optim_state_edit is not None:
        optim_state_edit(optim_state)
    path = tmp_path / "step_0000001"
    with warnings.catch_warnings():  # DCP warns that it runs without a process group
        warnings.simplefilter("ignore")
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    torch.save(_trainer_state(sched), path / TRAINER_STATE)
    return path, model, opt


def _load_sharded(path: Path) -> dict:
    model, opt, _ = _model_and_opt()
    with torch.no_grad():
        model.weight.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = load_sharded_checkpoint(path, model, opt)
    return {"state": state, "model": model, "opt": opt}


def test_a_sharded_checkpoint_loads_weights_only(tmp_path):
    path, model, opt = _sharded(tmp_path)
    got = _load_sharded(path)
    assert torch.equal(got["model"].weight, model.weight) and got["state"]["step"] == 1
    assert got["opt"].param_groups[0]["betas"] == (0.9, 0.95)


@pytest.mark.parametrize("where", ["trainer_state", "metadata", "dcp_item"])
def test_a_planted_pickle_in_a_sharded_checkpoint_is_refused_unrun(tmp_path, where):
    marker = tmp_path / "payload_ran"
    edit = None
    if where == "dcp_item":  # a non-tensor item DCP stores as torch.save bytes: the optimizer's lr
        def edit(optim_state):
            optim_state["param_groups"][0]["lr"] = Plant(marker)
    path, _, _ = _sharded(tmp_path, edit)
    if where == "trainer_state":
        torch.save({"step": 1, "evil": Plant(marker)}, path / TRAINER_STATE)
    elif where == "metadata":
        metadata = pickle.loads((path / ".metadata").read_bytes())
        metadata.planner_data = Plant(marker)
        buffer = io.BytesIO()
        pickle.dump(metadata, buffer)
        (path / ".metadata").write_bytes(buffer.getvalue())
    says = {"trainer_state": r"trainer_state\.pt' holds an object that is not a tensor",
            "metadata": r"its DCP metadata names posix\.mkdir, which is not one of torch\.distributed\.checkpoint",
            "dcp_item": r"item optim\.param_groups\..*lr' holds an object that is not a tensor"}[where]
    with pytest.raises(UnsafeCheckpointError, match=says):
        _load_sharded(path)
    assert not marker.exists()


class Construct:
    """Unpickled, calls ``cls(*args)``: a pickle naming a class of DCP's own modules that a ``Metadata`` is
    not made of (a writer, a reader, a plan)."""

    def __init__(self, cls: type, *args) -> None:
        self.cls, self.args = cls, args

    def __reduce__(self):
        return (self.cls, self.args)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_a_raw_pickle_checkpoint_is_refused_as_unsafe_unrun(tmp_path, protocol):
    """A ``pickle.dump`` (not torch.save) planted as a checkpoint: at protocol 4 and 5 the weights-only
    unpickler stops at the FRAME opcode before the global, and the file must still be named unsafe, with
    the global it names, not 'truncated or corrupt?'. Protocol 2 (torch.save's) was refused before too."""
    marker = tmp_path / "payload_ran"
    save_checkpoint(tmp_path / "ckpt", 2, {"step": 2, "w": torch.ones(2)})
    planted = tmp_path / "ckpt" / "step_0000004.pt"
    planted.write_bytes(pickle.dumps({"step": 4, "evil": Plant(marker)}, protocol=protocol))
    (tmp_path / "ckpt" / "latest").write_text(planted.name)
    with pytest.raises(UnsafeCheckpointError, match=r"step_0000004\.pt' holds an object that is not a tensor or a "
                                                    r"plain Python type \(.*GLOBAL posix\.mkdir.*\), and was not "
                                                    r"loaded") as e:
        load_checkpoint(tmp_path / "ckpt")
    assert "truncated or corrupt" not in str(e.value) and "delete it, or resume from another checkpoint" in str(e.value)
    path, info, skipped = find_complete_checkpoint(tmp_path / "ckpt")
    assert path.name == "step_0000002.pt" and "holds an object" in skipped[0]
    assert not marker.exists()
    pickle.loads(planted.read_bytes())  # the plant is real: an unsafe load runs it
    assert marker.exists()


def test_a_torch_save_zip_with_a_raw_pickle_inside_is_refused_as_unsafe(tmp_path):
    """torch.save's zip with its data.pkl swapped for a protocol-4 pickle: unsafe, naming the global."""
    import zipfile

    marker = tmp_path / "payload_ran"
    buffer = io.BytesIO()
    torch.save({"step": 1, "w": torch.ones(2)}, buffer)
    path = tmp_path / "step_0000001.pt"
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as src, zipfile.ZipFile(path, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            dst.writestr(item, pickle.dumps(Plant(marker), protocol=4) if item.filename.endswith("data.pkl") else data)
    with pytest.raises(UnsafeCheckpointError, match=r"GLOBAL posix\.mkdir"):
        load_checkpoint(path)
    assert not marker.exists()


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.9])
def test_a_truncated_legacy_checkpoint_is_corrupt_not_unsafe(tmp_path, cut):
    """torch.save's legacy (non-zip) format names torch's own rebuild globals: cut short, it is reported as
    corrupt, not as unsafe; whole, it loads."""
    from cp_attention.training.checkpoint import CorruptCheckpointError

    buffer = io.BytesIO()
    torch.save({"step": 3, "w": torch.arange(6.0), "nested": {"b": torch.ones(2, dtype=torch.bfloat16)}}, buffer,
               _use_new_zipfile_serialization=False)
    whole, path = buffer.getvalue(), tmp_path / "step_0000003.pt"
    path.write_bytes(whole)
    assert torch.equal(load_checkpoint(path)["w"], torch.arange(6.0))
    path.write_bytes(whole[:int(len(whole) * cut)])
    with pytest.raises(CorruptCheckpointError, match="truncated or corrupt") as e:
        load_checkpoint(path)
    assert not isinstance(e.value, UnsafeCheckpointError), str(e.value)


@pytest.mark.parametrize("name", ["filesystem.FileSystemWriter", "filesystem.FileSystemReader", "planner.LoadPlan",
                                  "metadata.StorageMeta"])
def test_dcp_metadata_naming_a_dcp_class_a_metadata_is_not_made_of_is_refused_unbuilt(tmp_path, monkeypatch, name):
    """A ``.metadata`` whose planner_data would construct a DCP writer, reader or plan: refused by name, the
    class never called. StorageMeta (a class Metadata is made of) is the control: it is built and loads."""
    import importlib

    module, cls_name = name.split(".")
    cls = getattr(importlib.import_module(f"torch.distributed.checkpoint.{module}"), cls_name)
    built = []
    init = cls.__init__

    def spy(self, *args, **kwargs):
        built.append(args)
        init(self, *args, **kwargs)

    args = {"filesystem": (str(tmp_path / "elsewhere"),), "planner": ([],), "metadata": ()}[module]
    path, model, _ = _sharded(tmp_path)
    metadata = pickle.loads((path / ".metadata").read_bytes())
    metadata.planner_data = {**metadata.planner_data, "planted": Construct(cls, *args)}
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    monkeypatch.setattr(cls, "__init__", spy)
    if name == "metadata.StorageMeta":
        assert torch.equal(_load_sharded(path)["model"].weight, model.weight) and built == [()]
        return
    with pytest.raises(UnsafeCheckpointError, match=rf"its DCP metadata names torch\.distributed\.checkpoint\."
                                                    rf"{name}, which is not one of torch\.distributed\.checkpoint's "
                                                    "metadata types"):
        _load_sharded(path)
    assert built == [], f"{name} was constructed from the checkpoint: {built}"
    pickle.loads((path / ".metadata").read_bytes())  # the plant is real: an unrestricted load builds it
    assert built


def test_a_dcp_checkpoint_of_every_dtype_and_nested_state_loads(tmp_path):
    """DCP's own metadata for tensors of several dtypes, nested dicts, lists and non-tensor items, saved to
    a str and to a Path checkpoint_id, passes the narrowed unpickler (every global it names is allowed)."""
    import torch.distributed.checkpoint as dcp

    from cp_attention.training.sharded_checkpoint import _read_dcp_metadata

    state = {"a": torch.arange(6, dtype=torch.int64).reshape(2, 3), "b": {"c": torch.ones(3, dtype=torch.bfloat16),
             "d": [torch.zeros(2, dtype=torch.float64), 3, "text"]}, "e": torch.ones(2, 2).t(), "f": 0.5}
    for where in (tmp_path / "as_path", str(tmp_path / "as_str")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=where)
        metadata = _read_dcp_metadata(Path(where))
        assert metadata == pickle.loads((Path(where) / ".metadata").read_bytes())
