"""One 2-process launch for DeepSpeed's optimizer offload, zero.Init, ZeRO-3 evaluation features and
the "auto" scheduler steps (they share the 2 CPU cores): optimizer offload under ZeRO-2/3 against the
same run without it, and its resume; a model built under zero.Init (partitioned at construction)
against ZeRO-3 without it; load_best_model_at_end under ZeRO-3 against DDP; predict_with_generate of
a tiny Transformers model under ZeRO-3 against generate() in one process; an epoch-based run whose
DeepSpeed scheduler takes its step count from the loop. Rank 0 writes results.json and tensors.safetensors.
Usage: torchrun --nproc_per_node=2 worker_zero3.py OUT [CHECK ...]"""

import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tests.strategies.contract.scenarios import ContractNet, config, full_weights, token_data, trainer_for  # noqa: E402

out = sys.argv[1]
checks = sys.argv[2:] or ["offload", "zero_init", "best", "generate", "scheduler"]
world = int(os.environ["WORLD_SIZE"])
rank = int(os.environ["RANK"])
root = os.path.join(out, "runs")
results: dict = {}
tensors: dict = {}


def ds(stage: int, offload: bool = False, **more):
    zero = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    if stage == 3:  # DeepSpeed keeps parameters under 1e5 elements whole on every rank by default: partition all
        zero["stage3_param_persistence_threshold"] = 0
    return {"deepspeed": {"zero_optimization": zero, **more}}


def keep(key: str, trainer) -> None:
    tensors.update({f"{key}/{k}": v for k, v in full_weights(trainer).items()})


if "offload" in checks or "zero_init" in checks:
    for stage in (2, 3):  # the runs without offload are the reference (kiln's torch AdamW)
        trainer = trainer_for("deepspeed", root, f"plain{stage}", world, **ds(stage))
        trainer.fit()
        keep(f"plain{stage}", trainer)

if "offload" in checks:
    save = {"save": {"strategy": "steps", "steps": 2}}
    for stage in (2, 3):
        key = f"offload{stage}"
        whole = trainer_for("deepspeed", root, key, world, **save, **ds(stage, offload=True))
        whole.fit()
        engine = whole.strategy.engine
        results[key] = {
            "optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
            "offload": bool(engine.zero_cpu_offload()),
        }
        keep(f"{key}/whole", whole)
        resumed = trainer_for(
            "deepspeed",
            root,
            key + "_b",
            world,
            resume_from_checkpoint=os.path.join(root, key, "checkpoint-2"),
            **ds(stage, offload=True),
        )
        resumed.fit()
        results[key]["resumed_steps"] = resumed.state.global_step
        keep(f"{key}/resumed", resumed)
    # zero_force_ds_cpu_optimizer: false keeps kiln's torch AdamW on the offloaded partition (no op to compile)
    torch_offload = trainer_for(
        "deepspeed", root, "offload2_torch", world, **ds(2, offload=True, zero_force_ds_cpu_optimizer=False)
    )
    torch_offload.fit()
    engine = torch_offload.strategy.engine
    results["offload2_torch"] = {
        "optimizer": type(engine.optimizer.optimizer).__name__,
        "offload": bool(engine.zero_cpu_offload()),
    }
    keep("offload2_torch", torch_offload)

if "zero_init" in checks:
    from kiln import Trainer

    def build() -> ContractNet:
        torch.manual_seed(0)  # as trainer_for builds the reference model
        return ContractNet()

    trainer = Trainer(
        model_init=build,
        config=config(root, "zero_init", world, **ds(3)),
        train_dataset=token_data(40, seed=1),
        eval_dataset=token_data(7, seed=2),
        strategy="deepspeed",
    )
    results["zero_init"] = {
        name: {
            "ds_numel": int(p.ds_numel),
            "local": int(p.ds_tensor.numel()),
            "numel": int(p.numel()),
            "full": list(p.ds_shape),
        }
        for name, p in trainer.model.named_parameters()
    }
    trainer.fit()
    keep("zero_init", trainer)

if "best" in checks:
    # greater_is_better on eval_loss picks the worst evaluation: with a falling loss that is the first
    # (checkpoint-2), so loading the best checkpoint visibly changes the weights
    best = {
        "eval_strategy": "steps",
        "eval_steps": 2,
        "save": {"strategy": "steps", "steps": 2},
        "load_best_model_at_end": True,
        "metric_for_best_model": "eval_loss",
        "greater_is_better": True,
    }
    for key, strategy, extra in [("best_ddp", "ddp", {}), ("best_zero3", "deepspeed", ds(3))]:
        trainer = trainer_for(strategy, root, key, world, **best, **extra)
        trainer.fit()
        results[key] = {
            "best": os.path.basename(trainer.state.best_model_checkpoint or ""),
            "eval_losses": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h],
        }
        keep(key, trainer)

if "generate" in checks:
    import transformers

    from kiln import Trainer

    def bart(plain: bool = False) -> "transformers.BartForConditionalGeneration":
        cfg = transformers.BartConfig(
            vocab_size=24,
            d_model=16,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            max_position_embeddings=32,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=1,
            decoder_start_token_id=1,
            forced_eos_token_id=None,
            forced_bos_token_id=None,
            init_std=0.5,
            dropout=0.0,
        )
        torch.manual_seed(0)  # from_config: HF's own ZeRO-3 construction (partitioned, weights initialised gathered)
        return (
            transformers.BartForConditionalGeneration(cfg)
            if plain
            else transformers.AutoModelForSeq2SeqLM.from_config(cfg)
        )

    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(3, 24, (8, 6), generator=g), torch.randint(3, 24, (8, 5), generator=g)
    rows = [
        {"input_ids": ids[i], "attention_mask": torch.ones(6, dtype=torch.long), "labels": labels[i]} for i in range(8)
    ]
    gen = {
        "max_length": 8,
        "eos_token_id": 7,
    }  # an id at which rows stop at different lengths: ranks finish at different steps
    cfg = config(root, "generate", world, predict_with_generate=True, max_steps=2, learning_rate=0.01, **ds(3))
    trainer = Trainer(model_init=bart, config=cfg, train_dataset=rows, strategy="deepspeed")
    initial = full_weights(trainer)
    before = trainer.predict(rows, **gen).predictions  # partitioned since construction (zero.Init)
    trainer.fit()
    after = trainer.predict(rows, **gen).predictions  # partitioned by the training engine
    trained = full_weights(trainer)
    if (
        rank == 0
    ):  # generate() in one process (not synced: the other rank is not generating), row by row like the 1-row eval batches
        plain = bart(plain=True).eval()
        reference = {"before": [], "after": []}
        for phase, weights in (("before", initial), ("after", trained)):
            plain.load_state_dict(weights)
            with torch.no_grad():
                for row in rows:
                    reference[phase].append(
                        plain.generate(
                            input_ids=row["input_ids"][None],
                            attention_mask=row["attention_mask"][None],
                            synced_gpus=False,
                            **gen,
                        )[0].tolist()
                    )
        results["generate"] = {
            "before": torch.as_tensor(before).tolist(),
            "after": torch.as_tensor(after).tolist(),
            "reference": reference,
            "partitioned": all(p.numel() == 0 for p in trainer.model.parameters()),
        }

if "scheduler" in checks:
    sched = {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    }
    trainer = trainer_for(
        "deepspeed",
        root,
        "scheduler",
        world,
        max_steps=-1,
        num_train_epochs=2,
        warmup_steps=0.25,
        **ds(2, scheduler=sched),
    )
    trainer.fit()
    params = trainer.strategy.ds_config["scheduler"]["params"]
    results["scheduler"] = {
        "max_steps": trainer.state.max_steps,
        "total_num_steps": params["total_num_steps"],
        "warmup_num_steps": params["warmup_num_steps"],
        "expected_warmup": math.ceil(0.25 * trainer.state.max_steps),
        "scheduler_total": trainer.lr_scheduler.total_num_steps,
        "lrs": [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h],
    }

if rank == 0:
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "tensors.safetensors"))
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump(results, fh)
