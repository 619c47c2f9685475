"""scripts/train.py end to end: outputs, DP x CP gradients, exact resume, sweeps, fail-fast configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs the hf extra")
import torch  # noqa: E402

from cp_attention.training.config import validate_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# trainer.device=cpu: these runs compare CPU results bit for bit, also on a machine with GPUs
# (tests/system/test_train_gpu.py trains on CUDA).
TINY = ["trainer.seq_len=64", "trainer.micro_batch=2", "trainer.log_every=1", "trainer.ckpt_every=0",
        "model.hidden_size=32", "model.intermediate_size=64", "trainer.device=cpu"]


def train(run_dir: Path, *overrides: str, launcher: list[str] | None = None, check: bool = True):
    keys = {o.split("=", 1)[0] for o in overrides}
    tiny = [o for o in TINY if o.split("=", 1)[0] not in keys]  # an explicit override replaces the tiny default
    cmd = (launcher or [sys.executable]) + ["scripts/train.py", *tiny, f"hydra.run.dir={run_dir}", *overrides]
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def weights(run_dir: Path) -> dict:
    from cp_attention.training import load_checkpoint

    return load_checkpoint(run_dir / "checkpoints")["model"]


def _summary(stdout: str) -> dict[str, str]:
    """The rows of the summary train.py prints last (``key  value``; a file row's key is indented)."""
    lines = stdout[stdout.index("== train.py: done"):].splitlines()[1:]
    return {line[:15].strip(): line[15:] for line in lines if line[:15].strip()}


@pytest.mark.slow
def test_outputs_and_falling_loss(tmp_path):
    """The default job, small: its files, a falling loss, a clean exit (no warning: the spawned ranks
    once leaked tqdm's semaphore), and a last summary naming files that exist."""
    proc = train(tmp_path, "trainer.steps=12")
    warned = [line for line in proc.stderr.splitlines() if any(w in line.lower() for w in ("warn", "leaked"))]
    assert not warned, proc.stderr[-3000:]
    rows = _summary(proc.stdout)
    assert rows["run directory"] == f"{tmp_path}/"
    for key in ("metrics", "checkpoint", "config", "loss curve"):
        assert (tmp_path / rows[key].split()[0]).is_file(), (key, rows[key])
    assert rows["checkpoint"].startswith("checkpoints/step_0000012.pt")
    assert rows["loss"].startswith("final ") and rows["throughput"].endswith(" tokens/s"), rows
    assert f"hydra.run.dir={tmp_path} trainer.resume_from=auto" in rows["resume"]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 13))
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.5, metrics  # bytes: ~5.6 at random init
    assert all(m["tokens_per_s"] > 0 for m in metrics)
    assert (tmp_path / "config.yaml").read_text().count("cp_size: 2") == 1
    assert (tmp_path / ".hydra" / "config.yaml").is_file()
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_0000012.pt"
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


@pytest.mark.slow
def test_dp_times_cp_gradients_match_dp_only(tmp_path):
    """One SGD step with lr=1 moves the weights by exactly the gradient."""
    sgd = ["optim=sgd", "optim.lr=1.0", "trainer.steps=1", "trainer.grad_clip=null"]
    train(tmp_path / "dp2cp2", "nproc=4", "cp_size=2", *sgd)
    train(tmp_path / "dp2", "nproc=2", "cp_size=1", *sgd)
    a, b = weights(tmp_path / "dp2cp2"), weights(tmp_path / "dp2")
    start = weights_at_init(tmp_path / "dp2")
    moved = max((a[k] - start[k]).abs().max().item() for k in a)
    assert moved > 1e-3  # the step did something
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-6, rtol=0, msg=k)


def _launcher_meshes(rank: int, world_size: int) -> dict:
    from cp_attention.training.run import training_mesh
    from cp_attention.transport import transport_for

    mesh, cp_mesh, group = training_mesh("cpu", 1, 4, {"name": "a2a+p2p", "inner": 2})
    transport = transport_for(group)
    outer, inner = transport.levels
    assert cp_mesh.get_local_rank() == transport.rank  # the data's CP rank is the attention's
    return {"cp": cp_mesh.size(), "flat_rank": transport.rank, "outer": (outer.rank, outer.world_size),
            "inner": (inner.rank, inner.world_size), "dp": mesh["dp"].size()}


def test_two_level_cp_mesh_of_the_launcher(pools):
    """cp_comm=a2a_p2p, cp_size=4, cp_comm.inner=2: a ring across 2 groups of 2, all-to-all inside each;
    the CP rank is the flattened rank (the model's exactness under it: tests/unit/strategies/test_strategies.py,
    tests/adapters/hf/test_loopback.py)."""
    for rank, got in enumerate(pools(4).run(_launcher_meshes)):
        assert got == {"cp": 4, "flat_rank": rank, "outer": (rank // 2, 2), "inner": (rank % 2, 2), "dp": 1}, got


def _config(*overrides: str) -> dict:
    """scripts/train.py's resolved config with ``overrides``, composed here (no process started)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return OmegaConf.to_container(compose(config_name="train", overrides=list(overrides)), resolve=True)


def _launcher_runs(rank: int, world_size: int, cfgs: list, run_dir: str, examples: list) -> list:
    """The launcher's loop on this pool's ranks, one run per config (into ``run_dir/i``), then the HF
    example's loop (examples/finetune_hf.py) once per ``examples`` entry (cp_comm_type, cp_a2a_size): its losses."""
    import argparse

    from cp_attention.training import loop
    from examples import finetune_hf as hf_example

    for i, cfg in enumerate(cfgs):
        os.makedirs(os.path.join(run_dir, str(i)), exist_ok=True)
        loop.train(cfg, os.path.join(run_dir, str(i)))
    return [hf_example.train(argparse.Namespace(
        layout="zigzag", kernel="auto", seq_len=32, batch=2, steps=2, lr=1e-2, seed=0, log_every=100, device="cpu",
        precision="fp32", cp_comm_type=comm, cp_a2a_size=a2a)) for comm, a2a in examples]


@pytest.mark.parametrize("world_size,comms,examples", [
    (2, ["p2p", "a2a", "all_gather", "auto"], [("p2p", None), ("a2a", None)]),
    (4, ["p2p", "a2a_p2p"], [("p2p", None), ("a2a+p2p", 2)]),
])
def test_every_strategy_trains_like_the_ring(pools, tmp_path, world_size, comms, examples):
    """cp_comm=...: one packed SGD step (lr=1) of the launcher moves the weights as the ring's does (the
    ring's equals one process: test_packed_cp2_matches_cp1); a2a_p2p on 4 ranks is a ring across 2 groups
    of 2 (cp_comm.inner=2). The HF example's --cp-comm-type/--cp-a2a-size likewise."""
    from cp_attention.training.config import build_model, validate_config

    sgd = ["data.packing=true", "optim=sgd", "optim.lr=1.0", "trainer.steps=1", "trainer.grad_clip=null"]
    cfgs = [_config(*TINY, *sgd, f"cp_size={world_size}", f"cp_comm={comm}") for comm in comms]
    for cfg in cfgs:
        validate_config(cfg, world_size)
    losses = pools(world_size).run(_launcher_runs, cfgs=cfgs, run_dir=str(tmp_path), examples=examples, timeout=240)
    ring = weights(tmp_path / "0")
    torch.manual_seed(cfgs[0]["trainer"]["seed"])
    start = build_model(cfgs[0]["model"]).state_dict()
    assert max((ring[k] - start[k]).abs().max().item() for k in ring) > 1e-3  # the step did something
    for i, comm in enumerate(comms[1:], 1):
        assert weights(tmp_path / str(i)).keys() == ring.keys()
        for k, w in weights(tmp_path / str(i)).items():
            torch.testing.assert_close(w, ring[k], atol=2e-6, rtol=0, msg=f"cp_comm={comm}: {k}")
    for rank_losses in losses:
        assert rank_losses == losses[0] and len(rank_losses[0]) == 2
        # fp32 losses after an AdamW step: within a few ulps of ~5.5 amplified by the step
        assert max(abs(a - b) for a, b in zip(rank_losses[1], rank_losses[0])) <= 1e-5, rank_losses


def weights_at_init(run_dir: Path) -> dict:
    """The initial weights of the run in ``run_dir``: its model built here as the launcher builds it
    (the same seed, the same CPU ops)."""
    from omegaconf import OmegaConf

    from cp_attention.training.config import build_model

    cfg = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)
    torch.manual_seed(cfg["trainer"]["seed"])
    return build_model(cfg["model"]).state_dict()


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path):
    train(tmp_path / "straight", "trainer.steps=6")
    train(tmp_path / "resumed", "trainer.steps=6", "trainer.stop_after=3")
    assert (tmp_path / "resumed" / "checkpoints" / "latest").read_text() == "step_0000003.pt"
    train(tmp_path / "resumed2", "trainer.steps=6", f"trainer.resume_from={tmp_path / 'resumed'}")
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed2")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_sweep_over_layouts(tmp_path):
    proc = subprocess.run(
        [sys.executable, "scripts/train.py", "-m", "layout=contiguous,interleaved", "trainer.steps=2", *TINY,
         f"hydra.sweep.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = sorted(p.name for p in tmp_path.iterdir() if (p / "metrics.jsonl").is_file())
    assert len(runs) == 2 and runs[0].startswith("0_layout=contiguous,") and \
        runs[1].startswith("1_layout=interleaved,"), runs
    assert proc.stdout.count("== train.py: done, step 2 of 2 (") == 2  # a summary per job, resumable by itself
    assert "layout=interleaved trainer.steps=2" in proc.stdout.split("(interleaved,")[1]


@pytest.mark.slow
def test_torchrun_ranks_share_one_output_dir(tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29611"]
    proc = train(tmp_path / "run", "trainer.steps=2", launcher=launcher)
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    assert proc.stdout.count("train zigzag") <= 1  # only rank 0 reports
    assert proc.stdout.count("== train.py: done") == 1 and "torchrun --nproc-per-node=2 scripts/train.py" in proc.stdout


@pytest.mark.parametrize("overrides,message", [
    (["trainer.seq_len=102"], "cannot be split by the zigzag layout over cp_size=2"),
    (["cp_size=3"], "cp_size=3 must divide the world size 2"),
    (["trainer.resume_from=/nonexistent/ckpt"], "no checkpoint at '/nonexistent/ckpt'"),
    (["layout=diagonal"], "Could not find 'layout/diagonal'"),
    (["kernel.name=warp"], "unknown kernel 'warp'"),
    (["data=text_file"], "data.source=text needs data.path"),
    (["trainer.dist_timeout_s=0"], "trainer.dist_timeout_s must be a positive number of seconds"),
    (["data=synthetic", "data.packing=true"], "data.source=synthetic has none"),
    (["data.packing=maybe"], "data.packing must be true or false"),
    (["cp_comm.name=ulysses"], "cp_comm.name: unknown cp_comm_type 'ulysses'"),  # more: test_cp_comm_is_checked
])
def test_bad_configs_fail_fast(tmp_path, overrides, message):
    proc = train(tmp_path, *overrides, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout, (proc.stderr + proc.stdout)[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("overrides,message", [
    (["cp_comm=a2a_p2p", "cp_size=2"], "cp_comm.inner=2: a2a+p2p needs the all-to-all size, an int > 1 that divides "
                                       "cp_size=2 and is smaller; set cp_comm.inner (or cp_comm=a2a for all of cp)"),
    (["cp_comm=a2a_p2p", "cp_comm.inner=3"], "cp_comm.inner=3: a2a+p2p needs the all-to-all size"),
    (["cp_comm=a2a_p2p", "cp_comm.inner=null"], "cp_comm.inner=None: a2a+p2p needs the all-to-all size"),
    (["cp_comm=p2p", "+cp_comm.inner=2"], "cp_comm.inner=2 is only for cp_comm=a2a_p2p; drop it"),
    (["cp_comm.name=ring"], "cp_comm.name: unknown cp_comm_type 'ring'; expected one of 'p2p', 'all_gather', 'a2a', "
                            "'a2a+p2p', 'auto'"),
    (["cp_comm=a2a_p2p", "trainer.fsdp=true"], "cp_comm=a2a_p2p with trainer.fsdp=true is not supported"),
    (["cp_comm=a2a", "model.num_attention_heads=6", "model.num_key_value_heads=2", "model.hidden_size=24"],
     "cp_comm=a2a splits the model's 6 query heads over cp_size=4 ranks, which does not divide them; use "
     "cp_comm=p2p, all_gather or auto, or a cp_size that divides 6"),
    (["cp_comm=a2a_p2p", "cp_size=8", "model.num_attention_heads=6", "model.num_key_value_heads=2",
      "model.hidden_size=24", "cp_comm.inner=4", "trainer.seq_len=128"],
     "cp_comm=a2a_p2p splits the model's 6 query heads over cp_comm.inner=4 ranks"),
])
def test_cp_comm_is_checked_before_any_rank_starts(overrides, message):
    """What scripts/train.py checks up front for cp_comm (test_bad_configs_fail_fast: that it reports it)."""
    from cp_attention.training.config import validate_config

    cfg = _config(*TINY, "cp_size=4", *overrides)
    with pytest.raises(ValueError) as e:
        validate_config(cfg, cfg["cp_size"])
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("overrides,message", [
    (["trainer.activation_checkpointing=sometimes"], "trainer.activation_checkpointing='sometimes': expected True"),
    (["trainer.mlp_chunks=0"], "trainer.mlp_chunks=0: expected None"),
    (["trainer.loss_chunk_tokens=0"], "trainer.loss_chunk_tokens=0: expected an int >= 1"),
    (["trainer.offload_optimizer=true"], "trainer.offload_optimizer=true needs trainer.fsdp=true"),
    (["trainer.offload_optimizer=maybe"], "trainer.offload_optimizer must be true or false, got 'maybe'"),
])
def test_memory_keys_are_checked_before_any_rank_starts(overrides, message):
    from cp_attention.training.config import validate_config

    cfg = _config(*TINY, *overrides)
    with pytest.raises(ValueError) as e:
        validate_config(cfg, cfg["cp_size"])
    assert message in str(e.value), str(e.value)


def _launcher_savers(rank: int, world_size: int, cfgs: list, run_dir: str) -> list:
    """The launcher's loop on this pool's ranks, one run per config (into ``run_dir/i``); per run, the
    savers it put on the model (save_memory's arguments) and the chunks of each lm_loss call."""
    from cp_attention.integrations import huggingface as cphf
    from cp_attention.integrations.huggingface import fsdp
    from cp_attention.training import loop

    calls: list = []
    real_loss, real_savers = cphf.lm_loss, cphf.save_memory

    def lm_loss(model, local, group=None, chunk_tokens=1024, num_items_in_batch=None):
        calls[-1].append(("lm_loss", chunk_tokens))
        return real_loss(model, local, group=group, chunk_tokens=chunk_tokens, num_items_in_batch=num_items_in_batch)

    def save_memory(model, checkpoint=True, mlp_chunks=None):
        calls[-1].append(("save_memory", checkpoint, mlp_chunks))
        return real_savers(model, checkpoint=checkpoint, mlp_chunks=mlp_chunks)

    cphf.lm_loss, cphf.save_memory, fsdp.save_memory = lm_loss, save_memory, save_memory
    try:
        for i, cfg in enumerate(cfgs):
            calls.append([])
            os.makedirs(os.path.join(run_dir, str(i)), exist_ok=True)
            loop.train(cfg, os.path.join(run_dir, str(i)))
    finally:
        cphf.lm_loss, cphf.save_memory, fsdp.save_memory = real_loss, real_savers, real_savers
    return calls


@pytest.mark.slow
def test_memory_savers_train_like_without(pools, tmp_path):
    """The loss in chunks (the default 1024 > a rank's tokens, and 7 tokens), checkpointing (offloaded),
    the MLP in chunks, and with FSDP the optimizer offloaded: the same losses, step after step, as the
    loss on the full logits without savers (fp32: equal up to rounding), and the same weights; the loop
    put the savers asked for on the model and took the loss through lm_loss in the chunks asked for."""
    base = [*TINY, "cp_size=2", "optim=sgd", "optim.lr=0.5", "trainer.steps=3", "trainer.grad_clip=null",
            "trainer.loss_chunk_tokens=null"]
    savers = ["trainer.loss_chunk_tokens=7", "trainer.activation_checkpointing=offload", "trainer.mlp_chunks=3"]
    runs = [base, [*base, "trainer.loss_chunk_tokens=1024"], [*base, *savers],
            [*base, "trainer.fsdp=true", "trainer.loss_chunk_tokens=5", "trainer.activation_checkpointing=true",
             "trainer.mlp_chunks=2", "trainer.offload_optimizer=true"]]
    cfgs = [_config(*overrides) for overrides in runs]
    for cfg in cfgs:
        validate_config(cfg, 2)
    calls = pools(2).run(_launcher_savers, cfgs=cfgs, run_dir=str(tmp_path), timeout=240)
    assert calls[0] == calls[1] == [[], [("lm_loss", 1024)] * 3, [("save_memory", "offload", 3)] + [("lm_loss", 7)] * 3,
                                    [("save_memory", True, 2)] + [("lm_loss", 5)] * 3], calls
    losses = [[json.loads(line)["loss"] for line in (tmp_path / str(i) / "metrics.jsonl").read_text().splitlines()]
              for i in range(len(runs))]
    assert len(losses[0]) == 3 and losses[0][-1] < losses[0][0] - 0.05, losses[0]  # the steps did something
    for i, got in enumerate(losses[1:], 1):
        assert max(abs(a - b) / b for a, b in zip(got, losses[0])) <= 1e-6, (runs[i][len(base):], got, losses[0])
    reference = weights(tmp_path / "0")
    for i in (1, 2):  # the single-file checkpoints' weights (the FSDP run's are sharded: its losses speak for them)
        for k, w in weights(tmp_path / str(i)).items():
            torch.testing.assert_close(w, reference[k], atol=1e-6, rtol=0, msg=f"{runs[i][len(base):]}: {k}")


@pytest.mark.slow
def test_packed_run_trains(tmp_path):
    """The default config (builtin help topics, cp=2) packed: loss falls."""
    train(tmp_path, "data.packing=true", "trainer.steps=12")
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 13))
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.5, metrics
    assert "packing: true" in (tmp_path / "config.yaml").read_text()


@pytest.mark.slow
def test_packed_cp2_matches_cp1(tmp_path):
    """One packed SGD step (lr=1): the CP=2 loss and weights equal the CP=1 run's on the same batch."""
    sgd = ["data.packing=true", "optim=sgd", "optim.lr=1.0", "trainer.steps=1", "trainer.grad_clip=null"]
    train(tmp_path / "cp2", "nproc=2", "cp_size=2", *sgd)
    train(tmp_path / "cp1", "nproc=1", "cp_size=1", *sgd)
    loss = [json.loads((tmp_path / r / "metrics.jsonl").read_text())["loss"] for r in ("cp2", "cp1")]
    assert loss[0] == pytest.approx(loss[1], abs=1e-5), loss
    a, b = weights(tmp_path / "cp2"), weights(tmp_path / "cp1")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-6, rtol=0, msg=k)


@pytest.mark.parametrize("seq_len", [1, 7, 16, 64])
def test_packer_rows_documents_and_resume(seq_len):
    from cp_attention.training.data import PackedBatches

    gen = torch.Generator().manual_seed(seq_len)
    lengths = [1, 3, 40, 5, 16, 17, 2, 100, 9, 1]
    docs = [torch.randint(0, 256, (n,), generator=gen) for n in lengths]
    packer = PackedBatches(docs, seq_len, seed=3)
    order = packer.order(0) + packer.order(1)
    assert sorted(packer.order(0)) == list(range(len(docs))) and packer.order(0) != packer.order(1)
    stream = torch.cat([docs[i] for i in order])  # two epochs, each in its shuffled order
    ids, pos = packer.next(stream.numel() // seq_len)
    assert ids.shape == pos.shape == (stream.numel() // seq_len, seq_len)  # every row exactly seq_len
    ids, pos = ids.flatten(), pos.flatten()
    assert torch.equal(ids, stream[: ids.numel()])  # documents contiguous and in order, nothing lost
    # positions restart at every document's start and every row's start (a split document's piece
    # is a document of its own), and count up by one in between
    starts = set(torch.cumsum(torch.tensor([0] + [docs[i].numel() for i in order]), 0).tolist())
    starts |= set(range(0, ids.numel(), seq_len))
    expected, last = [], 0
    for i in range(ids.numel()):
        last = i if i in starts else last
        expected.append(i - last)
    assert pos.tolist() == expected

    # resume: a fresh packer loaded with the state reproduces the next batches exactly
    a = PackedBatches(docs, seq_len, seed=3)
    for _ in range(5):
        a.next(2)
    b = PackedBatches(docs, seq_len, seed=99)  # the state carries the seed
    b.load_state_dict(a.state_dict())
    for _ in range(6):
        (ia, pa), (ib, pb) = a.next(2), b.next(2)
        assert torch.equal(ia, ib) and torch.equal(pa, pb)
    with pytest.raises(ValueError, match="not from a packed run"):
        b.load_state_dict({"generator": torch.Generator().get_state()})


def test_documents_of_each_source(tmp_path):
    from cp_attention.training.data import load_documents

    text = tmp_path / "t.txt"
    text.write_text("one\ntwo\n\n  three\n \n\nfour\n\n\n")
    assert [bytes(d.tolist()).decode() for d in load_documents("text", str(text))] == ["one\ntwo", "  three", "four"]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"text": "a b"}\n\n{"text": "\u00e9"}\n{"text": ""}\n')
    assert [bytes(d.tolist()).decode() for d in load_documents("jsonl", str(jsonl))] == ["a b", "\u00e9"]
    from pydoc_data.topics import topics

    assert len(load_documents("builtin")) == len(topics)
    with pytest.raises(ValueError, match="no documents to pack"):
        load_documents("synthetic")
