"""`TrainerState` (everything the loop knows, saved as trainer_state.json in every checkpoint) and
`TrainerControl` (flags callbacks set to make the loop log, evaluate, save or stop; saved in
trainer_state.json's `stateful_callbacks` as HF's ExportableState). Field names and meanings follow
Hugging Face so that HF callbacks read the same attributes.

trainer_state.json holds exactly HF's keys, so `transformers.TrainerState.load_from_json` (and every
HF tool built on it) reads a kiln checkpoint. kiln's own loop position (`LOOP_POSITION` fields) lives
on the same object for the loop's convenience but is written to a separate file by the checkpoint."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

#: kiln's fields that trainer_state.json does not hold (HF's TrainerState(**json) would refuse them)
LOOP_POSITION = ("epoch_index", "batches_into_epoch")


@dataclass
class TrainerState:
    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int = 0
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0.0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)
    # kiln: where inside the epoch the loop stands, so a resume jumps straight there (not in trainer_state.json)
    epoch_index: int = 0
    batches_into_epoch: int = 0

    def to_json(self) -> str:
        """HF's schema only: the loop position is saved apart (`loop_position()`)."""
        data = {k: v for k, v in dataclasses.asdict(self).items() if k not in LOOP_POSITION}
        return json.dumps(data, indent=2, sort_keys=True, allow_nan=True) + "\n"

    def loop_position(self) -> dict[str, int]:
        return {k: int(getattr(self, k)) for k in LOOP_POSITION}

    def set_loop_position(self, position: dict[str, Any]) -> None:
        for k in LOOP_POSITION:
            setattr(self, k, int(position.get(k, 0)))

    def save_to_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(self.to_json())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerState:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def load_from_json(cls, path: str) -> TrainerState:
        with open(path, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh))


@dataclass
class TrainerControl:
    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_training(self) -> None:
        self.should_training_stop = False

    def _new_epoch(self) -> None:
        self.should_epoch_stop = False

    def _new_step(self) -> None:
        self.should_save = False
        self.should_evaluate = False
        self.should_log = False

    # HF's ExportableState: trainer_state.json keeps these flags under stateful_callbacks["TrainerControl"]
    def state(self) -> dict[str, Any]:
        return {"args": dataclasses.asdict(self), "attributes": {}}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> TrainerControl:
        control = cls(**state["args"])
        for key, value in state.get("attributes", {}).items():
            setattr(control, key, value)
        return control
