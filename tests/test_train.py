"""tfedu.train: the schedule, the weight-decay groups, exact resume, atomic checkpoints, several processes."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tfedu.config import preset
from tfedu.data import TokenDataset, encode_bytes, load_pydoc_text
from tfedu.model import GPT
from tfedu.train import TrainConfig, evaluate, learning_rate, param_groups, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = preset("tiny")  # byte-level vocabulary, 2 layers, d_model 64


@pytest.fixture(scope="module")
def data():
    return TokenDataset.from_ids(encode_bytes(load_pydoc_text()[:40_000])).split(0.1)


def tiny_model(seed=0, **changes):
    torch.manual_seed(seed)
    return GPT(TINY.replace(**changes))


def test_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    cfg = TrainConfig(steps=200, lr=1e-3, warmup_steps=20, min_lr_ratio=0.1)
    lrs = [learning_rate(s, cfg) for s in range(cfg.steps)]
    assert lrs[0] == pytest.approx(1e-3 / 20) and lrs[19] == pytest.approx(1e-3)
    assert all(b > a for a, b in zip(lrs[:20], lrs[1:20]))  # rising during warm-up
    assert all(b <= a for a, b in zip(lrs[20:], lrs[21:]))  # never rising afterwards
    assert lrs[-1] == pytest.approx(1e-4)
    middle = 20 + (cfg.steps - 1 - 20) // 2
    assert lrs[middle] == pytest.approx(0.55e-3, rel=1e-2)  # halfway down the cosine: (max + min) / 2


def test_weight_decay_falls_on_matrices_only_and_each_parameter_is_in_one_group():
    model = tiny_model()
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    ids = [id(p) for p in decay["params"] + no_decay["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))  # tied W_U counted once
    assert model.unembed.weight is model.embed.weight


def test_training_lowers_the_loss_and_evaluates_on_schedule(data):
    train_data, val_data = data
    model = tiny_model()
    result = train(model, train_data, TrainConfig(steps=30, batch_size=8, lr=3e-3, warmup_steps=5, eval_every=10),
                   val_data=val_data, progress=False)
    assert [e["step"] for e in result.evals] == [10, 20, 30]
    assert result.losses[-1] < result.losses[0] - 1.0
    assert result.evals[-1]["val_loss"] < result.evals[0]["val_loss"]
    assert not model.training  # handed back in eval mode
    # evaluation is deterministic: the same windows every time
    assert evaluate(model, val_data, TINY.n_ctx) == evaluate(model, val_data, TINY.n_ctx)


def test_an_optimizer_class_called_like_adamw_replaces_it(data):
    train_data, _ = data
    cfg = TrainConfig(steps=6, batch_size=4, lr=3e-3, warmup_steps=2)
    default = train(tiny_model(), train_data, cfg, progress=False)
    given = train(tiny_model(), train_data, cfg, progress=False, optimizer_class=torch.optim.AdamW)
    assert given.losses == default.losses
    made = []

    class Recording(torch.optim.AdamW):
        def __init__(self, params, lr, betas):
            made.append((lr, betas))
            super().__init__(params, lr=lr, betas=betas)

    recorded = train(tiny_model(), train_data, cfg, progress=False, optimizer_class=Recording)
    assert made == [(cfg.lr, cfg.betas)] and recorded.losses == default.losses


def test_a_checkpoint_file_stores_atomically_and_restores_tensors_only(tmp_path):
    from tfedu.data import CheckpointFile

    checkpoints = CheckpointFile(tmp_path / "run.pt")
    assert not checkpoints.exists()
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*run.pt"):
        checkpoints.restore()
    checkpoints.store({"step": 2, "generator": torch.Generator().manual_seed(0).get_state()})
    assert checkpoints.restore()["step"] == 2 and not (tmp_path / "run.pt.part").exists()
    with pytest.raises(TypeError, match="a checkpoint is a dict"):
        checkpoints.store([1, 2])
    torch.save({"code": TrainConfig()}, tmp_path / "other.pt")  # an arbitrary object: unpickling it could run code
    with pytest.raises(Exception, match="(?i)weights.only|unsupported"):
        CheckpointFile(tmp_path / "other.pt").restore()


def test_resume_after_a_crash_continues_the_uninterrupted_loss_curve_exactly(data, tmp_path):
    train_data, val_data = data
    cfg = TrainConfig(steps=16, batch_size=4, warmup_steps=3, eval_every=5, lr=3e-3)
    changes = {"dropout": 0.1}  # dropout draws from torch's RNG: the checkpoint must restore it too
    whole = train(tiny_model(**changes), train_data, cfg, val_data=val_data, progress=False)

    def crash(record):
        if record["step"] == 12:
            raise RuntimeError("power cut")

    with pytest.raises(RuntimeError, match="power cut"):
        train(tiny_model(**changes), train_data, cfg, val_data=val_data, out_dir=tmp_path, on_step=crash, progress=False)
    torch.manual_seed(1234)  # the resumed process starts with other random state
    model = tiny_model(seed=99, **changes)  # and other weights: everything comes from the checkpoint
    resumed = train(model, train_data, cfg, val_data=val_data, out_dir=tmp_path, resume=True, progress=False)
    assert [r["step"] for r in resumed.history] == list(range(1, 17))
    assert resumed.losses == whole.losses  # bit for bit, steps 11..16 included
    assert resumed.evals == whole.evals


def test_a_crash_while_writing_a_checkpoint_leaves_the_previous_one_whole(data, tmp_path, monkeypatch):
    train_data, _ = data
    cfg = TrainConfig(steps=4, batch_size=2, warmup_steps=1, eval_every=2)
    train(tiny_model(), train_data, cfg, out_dir=tmp_path, progress=False)
    before = (tmp_path / "checkpoint.pt").read_bytes()
    real_save = torch.save

    def save_half(obj, f):
        real_save(obj, f)
        with open(f, "r+b") as handle:  # the disk fills up halfway through
            handle.truncate(1000)
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", save_half)
    with pytest.raises(OSError, match="No space"):
        train(tiny_model(), train_data, cfg.__class__(**{**cfg.__dict__, "steps": 6}), out_dir=tmp_path, resume=True,
              progress=False)
    assert (tmp_path / "checkpoint.pt").read_bytes() == before


def test_resume_without_a_checkpoint_says_where_it_looked(data, tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint.pt"):
        train(tiny_model(), data[0], TrainConfig(steps=2), out_dir=tmp_path, resume=True, progress=False)


def test_keyboard_interrupt_returns_what_was_trained(data, capsys):
    def interrupt(record):
        if record["step"] == 3:
            raise KeyboardInterrupt

    model = tiny_model()
    result = train(model, data[0], TrainConfig(steps=10, batch_size=2, warmup_steps=1), on_step=interrupt, progress=False)
    assert result.stopped_early and len(result.history) == 3
    assert "after step 3" in capsys.readouterr().out


@pytest.mark.parametrize("field, value", [("steps", 0), ("batch_size", -1), ("lr", 0.0), ("min_lr_ratio", 2.0)])
def test_bad_train_config_is_refused_with_its_name(field, value):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**{field: value})


def test_batch_size_must_split_evenly_over_processes(data, monkeypatch):
    monkeypatch.setattr("tfedu.train.start_processes", lambda device: __import__("tfedu.train").train.Processes(0, 3))
    with pytest.raises(ValueError, match="divide evenly over 3"):
        train(tiny_model(), data[0], TrainConfig(steps=1, batch_size=4), progress=False)


DDP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    from tfedu.config import preset
    from tfedu.data import TokenDataset, encode_bytes, load_pydoc_text
    from tfedu.model import GPT
    from tfedu.train import TrainConfig, train
    train_data, val_data = TokenDataset.from_ids(encode_bytes(load_pydoc_text()[:40_000])).split(0.1)
    torch.manual_seed(0)
    model = GPT(preset("tiny"))
    cfg = TrainConfig(steps=8, batch_size=8, warmup_steps=2, eval_every=4, eval_batches=2, lr=3e-3)
    result = train(model, train_data, cfg, val_data=val_data, progress=False)
    if int(os.environ.get("RANK", "0")) == 0:
        json.dump({"losses": result.losses, "evals": result.evals, "world": int(os.environ.get("WORLD_SIZE", "1"))},
                  open(sys.argv[1], "w"))
""")


def test_two_processes_under_torchrun_match_one_process_with_the_same_global_batch(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(DDP_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    subprocess.run([sys.executable, str(script), str(one)], check=True, env=env, timeout=300)
    # --standalone: torchrun's rendezvous binds port 0 itself, so no port can be taken between choosing and
    # binding it (a port found free by the test and closed again raced with other workers' kernels).
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script), str(two)], env=env, timeout=300, capture_output=True, text=True)
    assert run.returncode == 0, f"torchrun failed ({run.returncode}):\n{run.stderr[-3000:]}"
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert (a["world"], b["world"]) == (1, 2)
    torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor([e["val_loss"] for e in b["evals"]]),
                               torch.tensor([e["val_loss"] for e in a["evals"]]), rtol=1e-4, atol=1e-5)
    assert a["losses"][-1] < a["losses"][0]
