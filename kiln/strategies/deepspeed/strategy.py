"""`strategy: deepspeed` (and `deepspeed_stage_1/2/3`, `deepspeed_stage_2_offload`,
`deepspeed_stage_3_offload`): the model, optimizer and scheduler go through one
`deepspeed.initialize`, and DeepSpeed's engine owns the optimizer step, gradient reduction,
clipping, fp16 loss scaling and ZeRO partitioning (stages 0-3, CPU offload).

The DeepSpeed config comes from `strategy.config` (HF's `deepspeed` argument: a JSON path or a
mapping; accelerate launch's DeepSpeed settings arrive the same way) and is completed by
kiln.config.hf.deepspeed from kiln's config, which stays the single source of truth for accumulation
and clipping: kiln decides the accumulation boundary (`set_gradient_accumulation_boundary`) and
has already weighted the loss by the global item count, so the engine's backward does not divide
by the accumulation steps again (`scale_wrt_gas=False`). DeepSpeed averages gradients over the
world like DDP, so the loop's loss weights are DDP's.

Optimizer and scheduler follow HF's mixing rules: DeepSpeed's own when the config names them,
else kiln's (`zero_allow_untested_optimizer` set, as HF does). ZeRO-Offload needs a DeepSpeed
optimizer: with none in the config, kiln's Adam-family optimizer is translated into one (logged:
DeepSpeedCPUAdam, a JIT-compiled op), unless the config sets `zero_force_ds_cpu_optimizer: false`,
which keeps kiln's torch optimizer stepping the CPU partition (no compile).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kiln.config.hf.deepspeed import NAMED_STAGES, dtype_of, finalize, process, read_user_config
from kiln.launch.environment.variables import export_default, remove_default
from kiln.precision.base import Precision
from kiln.strategies import STRATEGIES
from kiln.strategies.base import OptimizerFactory, SchedulerFactory, Setup, StepResult, Strategy
from kiln.strategies.capabilities import Capabilities
from kiln.strategies.checkpoint_io import CheckpointIO
from kiln.strategies.collectives import ProcessGroupCollectives
from kiln.strategies.deepspeed.optimizer import ds_optimizer_from_kiln, offloads_optimizer
from kiln.strategies.deepspeed.precision import DeepSpeedPrecision
from kiln.strategies.deepspeed.runtime import (
    compiling,
    import_deepspeed,
    inner_model,
    is_engine,
    partitioned,
    release_engine_groups,
    without_shm_comm_op,
)
from kiln.strategies.interfaces import BackwardSyncControl, ShardedModuleInit
from kiln.strategies.process_group import register_group_user
from kiln.utils.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger(__name__)


@STRATEGIES.register("deepspeed", *[n for n in NAMED_STAGES if n != "deepspeed"])
class DeepSpeedStrategy(ProcessGroupCollectives, Strategy, BackwardSyncControl, ShardedModuleInit):
    name = "deepspeed"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        precisions=frozenset({"fp32", "fp16", "bf16", "fp16-true", "bf16-true"}),
        auto_batch_size=False,
        full_eval_cast=False,
        user_optimizer=False,
        owns_optimizer_step=True,
        reasons={
            "mps": "DeepSpeed has no Apple GPU accelerator",
            "xla": "DeepSpeed does not run on XLA devices",
            "fp8": "DeepSpeed's engine casts the model and runs its own mixed precision, which torchao's float8 "
            "layers are not wired into; use strategy fsdp, ddp or single with precision: fp8",
            "apex": "DeepSpeed's engine wraps the optimizer and scales the fp16 loss itself (apex's amp.initialize "
            "would wrap the optimizer a second time); use precision: fp16 or bf16",
        },
    )
    checkpoint_formats = ("deepspeed",)
    options = {
        "config": "DeepSpeed config: a JSON file path or a mapping (HF's `deepspeed` argument); \"auto\" values are filled from kiln's config.",
        "zero3_init_flag": "Build models the Trainer creates partitioned under deepspeed.zero.Init (ZeRO-3; default true).",
        "export_fp32": "save_model() under ZeRO writes the fp32 master weights instead of the 16-bit gathered ones (default false).",
    }

    def __init__(self, config: DictConfig, precision: Precision) -> None:
        super().__init__(config, precision)
        if self._device.type == "cpu":
            export_default("DS_ACCELERATOR", "cpu")  # else DeepSpeed guesses and warns
        user = read_user_config(self.option("config"))
        self.ds_config = process(
            config, user, world_size=self.world_size, precision=precision.name, name=config.strategy.name
        )
        self.stage = int(self.ds_config["zero_optimization"].get("stage", 0))
        self.engine: Any = None
        self._eval_module: nn.Module | None = None
        self._scheduler: Any = None
        self._hf_config: Any = None
        self._unpatched_build = False  # a Transformers model may have been built under zero.Init unpatched
        self._exported_local_rank = False  # LOCAL_RANK set by setup_environment, taken back at teardown

    # -- set-up -----------------------------------------------------------------------------
    def setup_environment(self) -> None:
        # imported before the group exists: deepspeed.comm binds `GroupMember.WORLD` as a default
        # argument at import, which would keep the group alive past teardown (see destroy_default_group)
        deepspeed = import_deepspeed()
        super().setup_environment()
        # DeepSpeed's engine asserts LOCAL_RANK, which torchrun and the deepspeed launcher export but a
        # plain `python` (kiln's one-process group) or srun do not; kiln knows it from the cluster
        self._exported_local_rank = export_default("LOCAL_RANK", str(self.local_rank))
        with without_shm_comm_op(deepspeed):
            compiling(lambda: deepspeed.init_distributed(dist_backend=self.backend))
        self._share_with_transformers()

    def _share_with_transformers(self) -> None:
        """Transformers reads the DeepSpeed config from a registry (`is_deepspeed_zero3_enabled`):
        under ZeRO-3 its `from_config`/`from_pretrained` build partitioned and initialise the
        gathered weights, and `generate()` keeps the ranks stepping together (`synced_gpus`). HF's
        Trainer registers it from TrainingArguments; the registry holds a weak reference, so the
        strategy keeps the object. Only when transformers is already imported (it is heavy)."""
        if "transformers" not in sys.modules or self._hf_config is not None:
            return
        from transformers.integrations.deepspeed import HfDeepSpeedConfig

        self._hf_config = HfDeepSpeedConfig(self.ds_config)

    def connect_precision(self, precision: Precision) -> Precision:
        dtype = dtype_of(self.ds_config)
        if not isinstance(precision, DeepSpeedPrecision):
            log.info(
                "strategy deepspeed: precision %r is applied by DeepSpeed's engine (%s) instead of kiln's plugin.",
                precision.name,
                f"{dtype}.enabled" if dtype else "fp32",
            )
            precision = DeepSpeedPrecision(precision, dtype, self)
        self.precision = precision
        return precision

    def module_init_context(self) -> contextlib.AbstractContextManager[Any]:
        """ZeRO-3 builds the model partitioned (HF's zero3_init_flag), so a model larger than one
        process's share fits; Transformers' weight initialisation is made to see the partitioned
        parameters (`deepspeed_init.py`), so calling a model class and `from_config` both work."""
        self._share_with_transformers()  # Transformers' from_pretrained loads into partitioned parameters
        if self.stage != 3:
            return contextlib.nullcontext()
        from kiln.strategies.deepspeed.zero_init import zero_init

        return zero_init(
            import_deepspeed(),
            self.ds_config,
            self._record_unpatched,
            partition=bool(self.option("zero3_init_flag", True)),
        )

    def _record_unpatched(self, unpatched: bool) -> None:
        self._unpatched_build = unpatched

    def _check_module(self, module: nn.Module) -> None:
        """Refuse, before anything runs, a model whose partitioning kiln cannot train correctly."""
        if not partitioned(module):
            return
        if self.stage != 3:
            raise ConfigError(
                f"The model's parameters are partitioned by deepspeed.zero.Init (ZeRO-3) but the DeepSpeed config "
                f"runs ZeRO-{self.stage}; use strategy deepspeed_stage_3 (zero_optimization.stage: 3) or build the "
                "model without zero.Init."
            )
        if self._unpatched_build:
            from kiln.strategies.deepspeed.zero_init import refuse_unpatched

            refuse_unpatched(module)

    def setup(
        self,
        module: nn.Module,
        optimizer_factory: OptimizerFactory | None = None,
        scheduler_factory: SchedulerFactory | None = None,
        *,
        max_steps: int | None = None,
    ) -> Setup:
        if self.engine is not None:
            return Setup(self.engine, self.engine.optimizer, self._scheduler)
        if optimizer_factory is None:  # evaluation before training: no engine yet
            return Setup(self._eval_setup(module))
        self._check_module(module)
        deepspeed = import_deepspeed()
        ds = finalize(dict(self.ds_config), inner_model(module), cfg=self.config, max_steps=max_steps)
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = None
        if "optimizer" not in ds:
            if offloads_optimizer(ds) and ds.get("zero_force_ds_cpu_optimizer", True):
                ds["optimizer"] = ds_optimizer_from_kiln(self.config)
            else:
                optimizer = optimizer_factory(module)
                if getattr(optimizer, "owns_backward", False):  # LOMO: DeepSpeed's engine runs backward itself
                    raise ConfigError(
                        f"{type(optimizer).__name__} updates parameters inside backward, which DeepSpeed's "
                        "engine runs itself; use strategy single (LOMO runs on one process)."
                    )
                ds["zero_allow_untested_optimizer"] = True  # HF's rule for a Trainer-made optimizer
        module = module if partitioned(module) else module.to(self.root_device)
        try:
            engine, ds_optimizer, _, ds_scheduler = compiling(
                lambda: deepspeed.initialize(model=module, model_parameters=params, optimizer=optimizer, config=ds)
            )
        except (AssertionError, ValueError) as err:  # DeepSpeed rejects a combination with an assert
            raise ConfigError(
                f"DeepSpeed refused this config ({err}); check zero_optimization's stage and offload settings."
            ) from None
        except Exception as err:
            if type(err).__name__ == "ZeRORuntimeException":
                raise ConfigError(f"DeepSpeed refused this config: {err}") from None
            raise
        self.engine, self.ds_config = engine, ds
        register_group_user(engine, release_engine_groups)  # an aborted fit must free the group (on gloo)
        if ds_scheduler is not None:  # kiln steps it after each applied step, like its own
            engine.lr_scheduler = None
            self._scheduler = ds_scheduler
        elif scheduler_factory is not None:
            self._scheduler = scheduler_factory(getattr(engine, "basic_optimizer", None) or optimizer or ds_optimizer)
        self._eval_module = None
        return Setup(engine, engine.optimizer, self._scheduler)

    def _eval_setup(self, module: nn.Module) -> nn.Module:
        if self._eval_module is None:
            self._check_module(module)
            if partitioned(module):  # built under zero.Init: only an engine can run it
                deepspeed = import_deepspeed()
                ds = {k: v for k, v in self.ds_config.items() if k not in ("optimizer", "scheduler")}
                self._eval_module = compiling(lambda: deepspeed.initialize(model=module, config=ds))[0]
            else:
                self._eval_module = module.to(self.root_device)
        return self._eval_module

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if is_engine(model) else model

    def probe_module(self, model: nn.Module) -> nn.Module:
        return self.unwrap(model)

    # -- step -------------------------------------------------------------------------------
    def micro_batch_context(self, model: nn.Module, *, boundary: bool) -> contextlib.AbstractContextManager[Any]:
        if is_engine(model):  # ZeRO reduces (or not) from backward hooks, so tell it before the forward
            model.set_gradient_accumulation_boundary(boundary)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, model: nn.Module, *, boundary: bool = True) -> None:
        engine = self._engine_of(model)
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(loss, scale_wrt_gas=False)  # kiln already weighted the loss over the window

    def optimizer_step(self, model: nn.Module, optimizer: Any, max_grad_norm: float | None) -> StepResult:
        engine = self._engine_of(model)
        clip = float(engine.gradient_clipping() or 0.0)
        if abs(clip - float(max_grad_norm or 0.0)) > 1e-12:  # cannot happen unless someone edits one copy
            raise ConfigError(
                f"DeepSpeed gradient_clipping={clip} but kiln's max_grad_norm={max_grad_norm}; they must agree."
            )
        own_norm = None
        if clip and not (self.stage or engine.fp16_enabled() or engine.bfloat16_enabled()):
            # ZeRO-0 fp32 clips torch's way without keeping the norm: measure it (after the all-reduce)
            grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
            own_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        skipped = engine.skipped_steps
        engine.step()
        stepped = engine.skipped_steps == skipped
        if not clip:
            return StepResult(stepped, None)
        norm = own_norm if own_norm is not None else engine.get_global_grad_norm()
        return StepResult(stepped, None if norm is None else torch.as_tensor(norm, dtype=torch.float32).detach())

    def zero_grad(self, model: nn.Module, optimizer: Any) -> None:
        """The engine zeroes (or keeps partitioned) gradients inside its own step."""

    def _engine_of(self, model: nn.Module) -> Any:
        if is_engine(model):
            return model
        if self.engine is not None:
            return self.engine
        raise RuntimeError("strategy deepspeed: training must run through the engine that setup() returned.")

    def teardown(self) -> None:
        """Unregister the DeepSpeed config from Transformers (else `is_deepspeed_zero3_enabled()` stays
        true after the run, and a model built later in this process would be built partitioned), then
        release the process group (ProcessGroupCollectives.teardown). Idempotent; only a config this
        strategy registered is unregistered."""
        if self._hf_config is not None and "transformers" in sys.modules:
            from transformers.integrations import deepspeed as hf_deepspeed

            ref = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
            if ref is None or ref() is self._hf_config:
                hf_deepspeed.unset_hf_deepspeed_config()
        self._hf_config = None
        super().teardown()
        if not torch.distributed.is_initialized() and "deepspeed.utils.groups" in sys.modules:
            # DeepSpeed caches its groups of the world (data parallel, its world clone); torch destroyed
            # them above, and a later DeepSpeed run in this process would reuse the dead ones
            from deepspeed.utils import groups

            groups._release_process_group_references()
        if self._exported_local_rank:
            remove_default("LOCAL_RANK")
            self._exported_local_rank = False
        _restore_torch_linear()

    # -- checkpoints and export -------------------------------------------------------------
    def checkpoint_io(self) -> CheckpointIO:
        from kiln.strategies.deepspeed.checkpoint_io import DeepSpeedCheckpointIO

        return DeepSpeedCheckpointIO(self)

    def model_state_for_export(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Full weights on every rank: ZeRO-3's partitioned parameters are gathered (16-bit, the
        engine's dtype), or with `export_fp32` the optimizer's fp32 master weights."""
        from kiln.strategies.deepspeed.checkpoint_io import gathered_state

        return gathered_state(module, fp32=bool(self.option("export_fp32", False)) and self.engine is not None)


def _restore_torch_linear() -> None:
    """ZeRO-3's `zero.Init` swaps `torch.nn.functional.linear` for DeepSpeed's memory-efficient one and
    leaves it there ("This will persist unless manually reset"): every linear layer run later in this
    process (another Trainer, a plain model) goes through it, and it fails on what torch's accepts. Put
    torch's back, only where DeepSpeed's own is in place; a later ZeRO-3 run swaps it in again."""
    module = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    if module is None:
        return
    original = getattr(module.InsertPostInitMethodToModuleSubClasses, "linear_bk", None)
    if original is not None and torch.nn.functional.linear is getattr(module, "zero3_linear_wrap", None):
        torch.nn.functional.linear = original
