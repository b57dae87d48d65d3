"""Lines a run must not print (issue 30 item 12d): `kiln predict` on an FSDP config naming strategy
'ddp' (FSDPStrategy inherits DDPStrategy.setup_environment, whose one-process warning hard-codes
'ddp'), and DeepSpeed's "Setting accelerator to CPU" when a non-DeepSpeed Transformers run is saved
(transformers' save_pretrained unwraps through accelerate's extract_model_from_parallel, which
imports deepspeed just to test isinstance(model, DeepSpeedEngine))."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from omegaconf import OmegaConf

from tests.distributed.conftest import REPO, kiln_cli
from tests.distributed.toy import write_cli_config


def test_predict_on_an_fsdp_config_does_not_speak_of_ddp(tmp_path):
    cfg = write_cli_config(str(tmp_path / "cfg.yaml"), str(tmp_path / "run"))
    conf = OmegaConf.load(cfg)
    conf.strategy = {"name": "fsdp", "device": "cpu"}
    OmegaConf.save(conf, cfg)
    proc = kiln_cli("predict", cfg, "--random-weights", check=False)
    assert "kiln: predicting with the untrained model" in proc.stdout, proc.stdout + proc.stderr
    assert "strategy 'ddp'" not in proc.stdout + proc.stderr


def test_saving_a_transformers_model_does_not_import_deepspeed(tmp_path):
    pytest.importorskip("transformers")
    script = textwrap.dedent(f"""
        import sys, torch
        from transformers import GPT2Config, GPT2LMHeadModel
        from kiln import Trainer
        cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
        data = [{{"input_ids": torch.randint(0, 64, (12,)), "labels": torch.randint(0, 64, (12,))}} for _ in range(8)]
        trainer = Trainer(GPT2LMHeadModel(cfg), {{"output_dir": {str(tmp_path)!r}, "max_steps": 1,
                          "per_device_train_batch_size": 4, "log": {{"disable_tqdm": True}}}}, train_dataset=data)
        trainer.fit()
        trainer.save_model()
        print("deepspeed imported:", "deepspeed" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "deepspeed imported: False" in proc.stdout and "Setting accelerator to CPU" not in proc.stderr
