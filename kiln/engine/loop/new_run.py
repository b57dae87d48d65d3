"""A second `fit()` / `train()` on the same Trainer starts a new training run, as in HF.

HF's rule: with `model_init`, the seed (possibly changed in the config since) is set again and a fresh
model is built, with a fresh optimizer and schedule; without it, training continues from the current
weights with the same optimizer. Either way the state starts over (step 0, empty log history, no best
metric), and a schedule the Trainer built itself is built again for the new run's length. Without this,
the second call would resume at the final step and train zero steps."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.engine.protocols import TrainerLike


def start_new_run(trainer: "TrainerLike", trial: Any = None) -> None:
    """Reset `trainer` for another run (called by fit() from its second call on)."""
    from kiln.engine.callbacks.state import TrainerControl, TrainerState
    from kiln.engine.model.model_init import call_model_init
    from kiln.engine.seed import set_seed

    t, cfg = trainer, trainer.config
    if t.model_init is not None:
        set_seed(cfg.seed, cfg.full_determinism)  # before the model is built, so its init follows the seed
        with t.strategy.module_init_context():
            t.model = call_model_init(t.model_init, trial)
        t._adopt_model(t.model)
        t.model_wrapped, t._setup_stage, t._forward_module = t.model, None, None  # the strategy sets it up anew
        t.optimizer, t.lr_scheduler = None, None  # they belong to the previous model (HF drops a given pair too)
        t._user_optimizer = False
        t.callback_handler.objects["model"] = t.model
    elif getattr(t, "_created_lr_scheduler", False):
        t.lr_scheduler = None  # its length and warmup were the previous run's
    t._created_lr_scheduler = False
    t.state = TrainerState(is_world_process_zero=t.strategy.is_global_zero, is_local_process_zero=t.strategy.is_local_zero)
    t.control = TrainerControl()
    t.checkpoints = type(t.checkpoints)(t)  # nothing pending from the previous run
