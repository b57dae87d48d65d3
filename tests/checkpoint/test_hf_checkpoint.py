"""Resume from a checkpoint written by Hugging Face's own Trainer (a user switching mid-training): a
tiny BERT built from a config (no downloads) is trained 3 steps by `transformers.Trainer`, then kiln
resumes its checkpoint-3 and says what it restored and what it could not."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kiln.engine.callbacks.base import Callback  # noqa: E402
from kiln.engine.checkpoint.files import latest_checkpoint  # noqa: E402
from kiln.engine.checkpoint.resume import resolve_resume  # noqa: E402
from kiln.engine.trainer import Trainer  # noqa: E402
from kiln.strategies.model_weights import load_weights  # noqa: E402

HYPER = {"max_steps": 6, "save_steps": 3, "per_device_train_batch_size": 4, "learning_rate": 1e-3, "logging_steps": 1}


def tiny_bert(seed: int):
    cfg = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
    )
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(cfg)


def data():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 50, (8,), generator=g), "labels": torch.tensor(i % 2)} for i in range(32)]


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf") / "out")
    args = transformers.TrainingArguments(
        output_dir=out,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        save_only_model=False,
        **{**HYPER, "max_steps": 3},
    )
    transformers.Trainer(model=tiny_bert(0), args=args, train_dataset=data()).train()
    return out


class FirstStep(Callback):
    """What the model and optimizer hold when the first resumed step begins."""

    def on_step_begin(self, config, state, control, **kw):
        if not hasattr(self, "weights"):
            self.step = state.global_step
            self.weights = {k: v.detach().clone() for k, v in kw["model"].state_dict().items()}
            self.torch_rng = torch.get_rng_state()  # kiln's sampler has its own generator: untouched since restore


def test_kiln_resumes_an_hf_trainer_checkpoint_and_says_what_it_could_not_restore(hf_run, tmp_path):
    ckpt = os.path.join(hf_run, "checkpoint-3")
    assert resolve_resume(ckpt, hf_run) == ckpt and latest_checkpoint(hf_run) == ckpt  # no marker needed
    probe = FirstStep()
    trainer = Trainer(
        tiny_bert(seed=123),
        {
            **HYPER,
            "output_dir": str(tmp_path / "kiln"),
            "report_to": "none",
            "disable_tqdm": True,
            "log": {"history": []},
        },
        train_dataset=data(),
        callbacks=[probe],
    )
    with pytest.warns(UserWarning) as record:
        trainer.fit(resume_from_checkpoint=ckpt)
    [note] = [str(w.message) for w in record if "Hugging Face checkpoint" in str(w.message)]
    assert (
        "restored weights, optimizer, scheduler, trainer state" in note and "RNG state" in note.split("not restored")[0]
    )
    assert "not restored: the sampler position" in note and "loss sums" in note

    assert probe.step == 3  # continued at HF's step, then trained to max_steps
    saved = load_weights(ckpt)
    assert all(torch.equal(probe.weights[k], saved[k]) for k in saved)
    hf_rng = torch.load(os.path.join(ckpt, "rng_state.pth"), weights_only=False)  # the test trusts its own file
    assert torch.equal(probe.torch_rng, hf_rng["cpu"])
    assert trainer.state.global_step == 6
    hf_state = transformers.TrainerState.load_from_json(os.path.join(ckpt, "trainer_state.json"))
    assert trainer.state.log_history[: len(hf_state.log_history)] == hf_state.log_history  # HF's history kept
    assert [e["step"] for e in trainer.state.log_history if "loss" in e][-3:] == [4, 5, 6]


def test_optimizer_and_schedule_continue_from_the_hf_checkpoint(hf_run, tmp_path):
    ckpt = os.path.join(hf_run, "checkpoint-3")
    trainer = Trainer(
        tiny_bert(seed=5),
        {
            **HYPER,
            "output_dir": str(tmp_path / "k"),
            "report_to": "none",
            "disable_tqdm": True,
            "log": {"history": []},
            "max_steps": 3,
        },
        train_dataset=data(),
    )
    with pytest.warns(UserWarning, match="Hugging Face checkpoint"):
        trainer.fit(resume_from_checkpoint=ckpt)  # max_steps reached: only loads
    hf_opt = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True)
    ours = trainer.optimizer.state_dict()
    assert all(torch.equal(ours["state"][i]["exp_avg"], hf_opt["state"][i]["exp_avg"]) for i in hf_opt["state"])
    assert trainer.lr_scheduler.last_epoch == 3


def test_changed_intervals_are_named(hf_run, tmp_path, caplog):
    trainer = Trainer(
        tiny_bert(seed=5),
        {
            **HYPER,
            "output_dir": str(tmp_path / "k"),
            "report_to": "none",
            "disable_tqdm": True,
            "log": {"history": []},
            "max_steps": 3,
            "logging_steps": 2,
        },
        train_dataset=data(),
    )
    with pytest.warns(UserWarning, match="Hugging Face checkpoint"):
        trainer.fit(resume_from_checkpoint=os.path.join(hf_run, "checkpoint-3"))
    assert "logging_steps: 2 (from args) != 1 (from trainer_state.json)" in caplog.text  # logged, as HF does


def test_weights_saved_without_their_tied_copy_load(tmp_path):
    """save_pretrained stores GPT-2's lm_head.weight once, as wte.weight: loading must not call it missing."""
    from kiln.strategies.model_weights import apply_weights

    cfg = transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    torch.manual_seed(0)
    source = transformers.GPT2LMHeadModel(cfg)
    source.save_pretrained(str(tmp_path / "gpt2"))
    state = load_weights(str(tmp_path / "gpt2"))
    assert "lm_head.weight" not in state
    torch.manual_seed(1)
    target = transformers.GPT2LMHeadModel(cfg)
    apply_weights(target, state, str(tmp_path / "gpt2"))
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in target.state_dict().items())


def test_each_rank_takes_the_hf_rng_file_of_its_global_rank(hf_run, tmp_path):
    """HF's Trainer on N processes writes `rng_state_<process_index>.pth`, its global rank. Global rank 2
    (node 1's local rank 0 of a 2 x 2 job, reading its node's copy with save_on_each_node) takes
    rng_state_2.pth, not its local rank's rng_state_0.pth."""
    import shutil

    from tests.topology.fake_world import stand_in

    ckpt = tmp_path / "hf4" / "checkpoint-3"
    shutil.copytree(os.path.join(hf_run, "checkpoint-3"), ckpt)
    single = torch.load(ckpt / "rng_state.pth", weights_only=False)  # the test trusts its own file
    (ckpt / "rng_state.pth").unlink()
    streams = {}
    for rank in range(4):
        streams[rank] = torch.Generator().manual_seed(100 + rank).get_state()
        torch.save({**single, "cpu": streams[rank]}, ckpt / f"rng_state_{rank}.pth")
    probe = FirstStep()
    trainer = Trainer(
        tiny_bert(seed=5),
        {
            **HYPER,
            "output_dir": str(tmp_path / "k"),
            "report_to": "none",
            "disable_tqdm": True,
            "log": {"history": []},
            "save_on_each_node": True,
        },
        train_dataset=data(),
        callbacks=[probe],
        strategy=stand_in(2),
    )
    with pytest.warns(UserWarning, match="Hugging Face checkpoint"):
        trainer.fit(resume_from_checkpoint=str(ckpt))
    assert torch.equal(probe.torch_rng, streams[2])


class ResumedMoments(Callback):
    """The optimizer state, whole and keyed by parameter name, when the first resumed step begins."""

    def on_step_begin(self, config, state, control, **kw):
        if hasattr(self, "moments"):
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        model, optimizer = kw["model"], kw["optimizer"]
        full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
        self.moments = {
            name: {k: torch.as_tensor(v).clone() for k, v in s.items()} for name, s in full["state"].items()
        }


def test_an_hf_checkpoint_resumes_under_fsdp_through_the_portable_state_bitwise_like_single(hf_run, tmp_path):
    """HF's optimizer.pt holds full tensors keyed by flat index; under FSDP (one gloo process, which
    computes what one device does) it is loaded through the portable state into the sharded optimizer,
    as a kiln `full` checkpoint is: the moments at the first resumed step and the final weights equal
    the single-device resume's, bit for bit."""
    import torch.distributed as dist

    from tests.strategies.test_ddp_strategy import no_launcher  # noqa: F401 (no torchrun variables)

    ckpt = os.path.join(hf_run, "checkpoint-3")
    result = {}
    for name, strategy in (("single", {"name": "single"}), ("fsdp", {"name": "fsdp", "state_dict_type": "sharded"})):
        probe = ResumedMoments()
        cfg = {**HYPER, "output_dir": str(tmp_path / name), "report_to": "none", "disable_tqdm": True}
        trainer = Trainer(
            tiny_bert(seed=5),
            {**cfg, "log": {"history": []}, "strategy": {**strategy, "device": "cpu"}, "save_strategy": "no"},
            train_dataset=data(),
            callbacks=[probe],
        )
        try:
            with pytest.warns(UserWarning, match="restored weights, optimizer"):
                trainer.fit(resume_from_checkpoint=ckpt)
            result[name] = probe.moments, trainer.strategy.model_state_for_export(trainer.model)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    (single_moments, single_weights), (fsdp_moments, fsdp_weights) = result["single"], result["fsdp"]
    assert set(fsdp_moments) == set(single_moments) and single_moments
    for param, moments in single_moments.items():
        assert set(moments) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in moments.items():
            assert torch.equal(fsdp_moments[param][key], value), (param, key)
    assert set(fsdp_weights) == set(single_weights)
    for key, value in single_weights.items():
        assert torch.equal(fsdp_weights[key], value), key
