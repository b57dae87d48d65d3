"""`strategy: model_parallel`: N-D parallelism on one named DeviceMesh -- FSDP2 (`fully_shard`) over
the data-parallel axes (dp_replicate, dp_shard, with cp flattened into dp_shard), tensor parallelism
(`parallelize_module`) over the `tp` axis, composed as torchtitan does (TP first, then FSDP over the
TP-split DTensors), and context parallelism over the `cp` axis (context_parallel.py).

    strategy: {name: model_parallel, mesh: {dp_shard: 2, tp: 2}, tp_plan: auto}
    strategy: {name: model_parallel, mesh: {tp: 2}, sequence_parallel: true, loss_parallel: true}

The mesh is mesh.py (its axes, -1, HF's parallelism_config), the plan tp_plan.py, sequence and
loss parallelism over the tp axis sequence_parallel.py and loss_parallel.py; a TrainingModule
that defines `configure_model(mesh)` parallelises itself instead of the plan (FSDP over the dp axes
still follows, on whatever it did not shard itself). Checkpoints are DCP (checkpoint_io.py).

Sizes and collectives: the `cp * tp` ranks of one data shard read the same batches, so the sampler
sees `data_shards = dp_replicate * dp_shard` replicas. Under cp each rank then keeps its own chunk
of those sequences (`batch_to_device`), so `item_shards = dp_replicate * dp_shard * cp` ranks hold
distinct tokens. See `reduce` for what sums and means count; `all_gather` / `all_gather_object` keep
one entry per data shard (its first rank's: evaluation is not context parallel, so the cp ranks'
outputs are copies); max / min, `broadcast_object` and `barrier` span every rank (a flag raised on
any rank reaches all of them). FSDP2 divides the reduced gradients by the size of its mesh,
dp x cp, so `grad_divisor` is it.

Precision: fp32 or bf16. With data-parallel axes bf16 is FSDP2's MixedPrecisionPolicy (bf16
compute, fp32 gradient reduction, as strategy fsdp); with tp alone it stays autocast.

Process group and device are DDP's (one process per device, started by a launcher)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional

import torch
from torch import nn

from kiln.strategies import STRATEGIES
from kiln.strategies.capabilities import Capabilities
from kiln.strategies.checkpoint_io import CheckpointIO
from kiln.strategies.ddp.strategy import DDPStrategy
from kiln.strategies.model_parallel.mesh import MeshShape, build_device_mesh, dp_mesh, flatten_axes, parse_mesh
from kiln.strategies.process_group import register_group_user
from kiln.utils.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kiln.precision.base import Precision

log = logging.getLogger(__name__)


@STRATEGIES.register("model_parallel")
class ModelParallelStrategy(DDPStrategy):
    name = "model_parallel"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        precisions=frozenset({"fp32", "bf16"}),
        auto_batch_size=False,
        full_eval_cast=False,
        user_optimizer=False,
        torch_compile=False,
        reasons={"mps": "it needs gloo or NCCL collectives and DTensor support, which Apple GPUs do not have "
                        "(one MPS device: strategy mps)",
                 "xla": "XLA devices shard through XLA's own SPMD (use strategy xla_fsdp)",
                 **{p: "model_parallel has been tested in fp32 and bf16 only; use precision: bf16 or fp32 (or "
                       "strategy fsdp for the others)" for p in ("fp16", "bf16-true", "fp16-true", "tf32", "apex")},
                 "torch_compile": "compiling tensor-parallel DTensor modules has not been tested with it yet"},
    )
    options = {
        "mesh": "axis sizes {dp_replicate, dp_shard, cp, tp}; missing axes are 1, one may be -1 (the rest); "
                "default {dp_shard: -1}",
        "tp_plan": "auto (the Transformers model's plan) or {module-name pattern: colwise | rowwise | "
                   "colwise_gather_output | embedding_rowwise | replicate}",
        "wrap": "FSDP unit classes over the dp axes (default the model's _no_split_modules)",
        "cp_load_balance": "with cp: cut each sequence in 2 x cp pieces, rank r keeping pieces r and 2cp-1-r "
                           "(torch's head-tail order, balancing causal attention's work; the default, true), or false: "
                           "piece r of cp",
        "sequence_parallel": "true: the activations between the tp_plan's TP regions are split by sequence (norms "
                             "run on 1/tp of the tokens; reduce-scatter + all-gather instead of all-reduce); "
                             "derived from the plan, refused where kiln cannot derive it; default false",
        "loss_parallel": "true: the head's logits stay split by vocabulary and the model's cross entropy runs on "
                         "the split (HF ForCausalLMLoss; else the head stays gathered, with a log line); "
                         "default false",
    }
    checkpoint_formats = ("model-parallel-dcp",)

    def __init__(self, config: "DictConfig", precision: "Precision") -> None:
        super().__init__(config, precision)
        self.shape: MeshShape = parse_mesh(self.option("mesh"), self.world_size)
        self._check_cp_config()
        self.device_mesh: Any = None
        self._cp_rank = 0
        self._dp_group: Any = None
        self._root: Optional[nn.Module] = None
        self._mp_policy: Any = None
        self._loss_parallel: Any = None  # loss_parallel.LossParallel once the head keeps split logits
        self._check_tp_options()

    # -- topology ---------------------------------------------------------------------------
    @property
    def data_shards(self) -> int:
        return self.shape.dp

    @property
    def data_shard_rank(self) -> int:
        return self.shape.data_rank(self.global_rank)

    @property
    def item_shards(self) -> int:
        return self.shape.dp_cp

    @property
    def grad_divisor(self) -> int:
        return self.shape.dp_cp

    @property
    def cp_load_balance(self) -> bool:
        """Whether cp splits sequences in torch's head-tail order (the option, default true)."""
        value = self.option("cp_load_balance", True)
        if not isinstance(value, bool):
            raise ConfigError(f"strategy.cp_load_balance is {value!r}; give true or false.")
        return value

    def _check_cp_config(self) -> None:
        """What cp has not been made to work with, refused before any process group starts."""
        if self.shape.cp == 1 or self.config is None:
            return
        _ = self.cp_load_balance  # a wrong value fails here, not at the first batch
        train = self.config.train
        if train.label_smoothing_factor:
            raise ConfigError("label_smoothing_factor with strategy.mesh.cp > 1 is not supported: kiln's label smoother "
                              "shifts each rank's chunk of labels itself and would drop every chunk boundary's target.")
        if train.neftune_noise_alpha:
            raise ConfigError("neftune_noise_alpha with strategy.mesh.cp > 1 is not supported: NEFTune scales its noise "
                              "by the sequence length, which each cp rank sees as its chunk's.")

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.device_mesh is not None:
            return
        from kiln.strategies.fsdp.strategy import _release_mesh_groups

        self.shape = parse_mesh(self.option("mesh"), self.world_size)  # a group made outside kiln sets the world
        self._check_cp_config()
        self.device_mesh = build_device_mesh(self.shape, self.root_device.type)
        register_group_user(self.device_mesh, _release_mesh_groups)
        s = self.shape
        # flattened mesh axes: their groups are the mesh's own (same backend, released with it)
        self._dp_group = flatten_axes(self.device_mesh, s)  # with tp: the ranks of my TP position with other data
        self._cp_rank = self.device_mesh["cp"].get_local_rank()
        log.info("model_parallel: %s over %d process(es).", s.describe(), self.world_size)

    def _check_tp_options(self) -> None:
        """sequence_parallel / loss_parallel change how the tp axis splits activations: refused, one
        sentence each, where they are not a yes/no or there is no tp axis (before any group starts)."""
        for key in ("sequence_parallel", "loss_parallel"):
            value = self.option(key, False)
            if not isinstance(value, bool):
                raise ConfigError(f"strategy.{key} is {value!r}; give true or false.")
            if value and self.shape.tp == 1:
                raise ConfigError(f"strategy.{key} splits the activations of tensor parallelism, and this mesh has no "
                                  f"tp axis ({self.shape.describe()}); set mesh.tp to 2 or more, or drop {key}.")

    # -- set-up -----------------------------------------------------------------------------
    def connect_precision(self, precision: "Precision") -> "Precision":
        """bf16 over data-parallel or cp axes becomes FSDP2's MixedPrecisionPolicy (as strategy fsdp
        does: parameters, TP-split ones included, gathered in bf16, gradients reduced in fp32); with
        one rank in dp x cp no FSDP runs, so autocast stays (it casts the TP layers' DTensor inputs too)."""
        from kiln.strategies.fsdp.precision import fsdp_precision

        if self.shape.dp_cp > 1:
            precision, self._mp_policy = fsdp_precision(precision, self.root_device)
        return super().connect_precision(precision)

    def setup_module(self, module: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        from kiln.strategies.fsdp.strategy import _release_groups
        from kiln.strategies.fsdp.wrap import blocks_to_wrap, sync_module_states
        from kiln.strategies.model_parallel.context_parallel import check_model
        from kiln.strategies.model_parallel.presharded import is_loaded_split
        from kiln.strategies.model_parallel.tp_plan import apply_plan, user_module

        if self.device_mesh is None:
            self.setup_environment()
        s, mesh = self.shape, self.device_mesh
        if s.cp > 1:  # before any work: attention CP cannot shard is refused here
            check_model(module, self.root_device.type)
        module = module.to(self.root_device)
        user = user_module(module)
        loaded_split = is_loaded_split(user)  # split by transformers at load: its DTensors stay as they are
        if self.world_size > 1 and not loaded_split:  # every rank starts from rank 0's weights, whatever seed built them
            sync_module_states(module)
        hook = getattr(user, "configure_model", None)
        plan = self.option("tp_plan")
        sp, lp = bool(self.option("sequence_parallel", False)), bool(self.option("loss_parallel", False))
        if loaded_split:
            what = f"the tensor parallelism transformers applied at load (tp {s.tp})"
        elif callable(hook):
            given = [key for key, on in (("tp_plan", plan is not None), ("sequence_parallel", sp), ("loss_parallel", lp)) if on]
            if given:
                raise ConfigError(f"{type(user).__name__} defines configure_model(mesh), which parallelises the model "
                                  f"itself, and strategy.{' and strategy.'.join(given)} {'is' if len(given) == 1 else 'are'}"
                                  " set too; drop one of them (configure_model can apply torch's SequenceParallel and "
                                  "loss_parallel itself).")
            hook(mesh)  # the user's own parallelize code (TP, and FSDP on blocks if it wants)
            what = "configure_model(mesh)"
        elif s.tp > 1:
            tp = apply_plan(user, mesh["tp"], plan, s.tp, sequence_parallel=sp, loss_parallel=lp)
            self._loss_parallel = tp.loss_parallel
            what = (f"{tp.layers} tensor-parallel layer(s)" + (", sequence parallel" if tp.sequence_parallel else "")
                    + (", loss parallel" if tp.loss_parallel is not None else ""))
        else:
            what = "no tensor parallelism"
        if s.dp_cp > 1:  # with cp alone too: the cp ranks' gradients (from different tokens) are reduced by FSDP
            fsdp_mesh = dp_mesh(mesh, s)
            kwargs: dict[str, Any] = {"mesh": fsdp_mesh, "reshard_after_forward": True}
            if self._mp_policy is not None:
                kwargs["mp_policy"] = self._mp_policy
            wrap = self.option("wrap")
            for block in blocks_to_wrap(module, None if wrap is None else list(wrap), None):  # innermost first
                if not _is_fsdp(block):
                    fully_shard(block, **kwargs)
            if not _is_fsdp(module):
                fully_shard(module, **kwargs)
            register_group_user(module, _release_groups)
        log.info("model_parallel: %s, FSDP over %d rank(s) (dp x cp).", what, s.dp_cp)
        self._root = module
        return module

    def unwrap(self, model: nn.Module) -> nn.Module:
        """Both parallelisms change the module in place: the wrapped module is the user's module."""
        return getattr(model, "_orig_mod", model)

    def batch_to_device(self, batch: Any) -> Any:
        """Under cp, a training batch becomes this rank's chunk of its sequences (with shift_labels and
        position_ids made before the split: context_parallel.prepare_batch), split on the host before
        it moves. Evaluation batches (the module in eval mode) stay whole: evaluation is not context
        parallel, every cp rank computes the full sequences."""
        if self.shape.cp > 1 and self._root is not None and self._root.training:
            from kiln.strategies.model_parallel.context_parallel import prepare_batch

            batch = prepare_batch(batch, self.shape.cp, self._cp_rank, self.cp_load_balance)
        return super().batch_to_device(batch)

    # -- step -------------------------------------------------------------------------------
    def micro_batch_context(self, model: nn.Module, *, boundary: bool) -> ContextManager[Any]:
        """FSDP reduce-scatters once per accumulation window, on its last micro-batch. Under cp the
        micro-batch's forward and backward run inside torch's ring-attention dispatcher; with loss
        parallel inside torch's `loss_parallel()`; with both (cp x tp), inside both."""
        root = self.unwrap(model)
        if _is_fsdp(root):
            root.set_requires_gradient_sync(boundary)
        contexts: list[ContextManager[Any]] = []
        if self.shape.cp > 1:
            from kiln.strategies.model_parallel.context_parallel import ring_attention

            contexts.append(ring_attention(self.device_mesh["cp"], self.cp_load_balance))
        if self._loss_parallel is not None:
            contexts.append(self._loss_parallel.context())
        return _all_of(contexts)

    def clip_gradients(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """The true global 2-norm. Gradients live on different meshes (TP-split layers on (dp, tp),
        the rest on the dp mesh alone -- under cp its shard axis is dp_shard_cp -- or plain tensors
        without FSDP), which DTensor's own norm cannot mix, so
        each rank sums its local squares, each weighted by 1 / (the number of ranks holding that same
        shard), and one all-reduce over every rank adds them up; every shard is then scaled alike."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor, Replicate

        world = self.world_size
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        local = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]  # the storage this rank holds
        total = torch.zeros((), dtype=torch.float32, device=self.root_device)
        with torch.no_grad():
            for g, mine in zip(grads, local):
                distinct = 1  # how many different pieces of this gradient the ranks hold
                if isinstance(g, DTensor):
                    for dim, placement in enumerate(g.placements):
                        if not isinstance(placement, Replicate):  # Shard, or FSDP's _StridedShard over TP
                            distinct *= g.device_mesh.size(dim)
                total += mine.float().pow(2).sum() * (distinct / world)
            if world > 1:
                dist.all_reduce(total)
            norm = total.sqrt()
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for mine in local:
                mine.mul_(coef.to(mine.dtype))
        return norm

    def probe_module(self, model: nn.Module) -> nn.Module:  # never called: capabilities.auto_batch_size is False
        raise NotImplementedError("auto_find_batch_size is not supported with strategy 'model_parallel'.")

    # -- collectives: each distinct value counted once ---------------------------------------
    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """sum and mean span the ranks whose values differ: the data shards and, within one, the cp
        ranks (each holds its own chunk of the sequences, so item and token counts, FLOPs and the
        loss weighted by them add up over dp x cp: each token once); the tp ranks of one position
        hold copies and count once (the reduction runs over the ranks at this rank's tp position,
        `dp x cp` of them). A value that is the same on the cp ranks of one data shard (per sample:
        a sample count, anything from evaluation, which is not context parallel) must be reduced with
        mean, max or min -- a sum would count it cp times. kiln's training loop sums only values
        counted on the rank's own chunk. max / min span every rank."""
        if op in ("max", "min") or self.shape.tp == 1:  # without tp every rank holds distinct data
            return super().reduce(tensor, op)
        import torch.distributed as dist

        if op not in ("sum", "mean"):
            return super().reduce(tensor, op)  # refuses the unknown op with DDP's sentence
        t = self._comm(torch.as_tensor(tensor))
        if op == "mean" and not t.is_floating_point():
            t = t.double()
        if self._dp_group is not None:
            dist.all_reduce(t, group=self._dp_group)
        if op == "mean":
            t = t / self.shape.dp_cp
        return t.to(torch.as_tensor(tensor).device)

    def reduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Callable[[], torch.Tensor]:
        if op != "sum" or self.shape.tp == 1:
            return super().reduce_async(tensor, op)
        import torch.distributed as dist

        t, device = self._comm(torch.as_tensor(tensor)), torch.as_tensor(tensor).device
        work = dist.all_reduce(t, group=self._dp_group, async_op=True) if self._dp_group is not None else None

        def wait() -> torch.Tensor:
            if work is not None:
                work.wait()
            return t.to(device)

        return wait

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return super().all_gather(tensor)[:: self.shape.model_ranks]

    def all_gather_object(self, obj: Any) -> list[Any]:
        return super().all_gather_object(obj)[:: self.shape.model_ranks]

    # -- checkpoints and export -------------------------------------------------------------
    def checkpoint_io(self) -> CheckpointIO:
        from kiln.strategies.model_parallel.checkpoint_io import ModelParallelCheckpointIO

        return ModelParallelCheckpointIO(self)

    def model_state_for_export(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The full weights (FSDP shards and TP splits gathered) with the module's own key names, on
        CPU; rank 0 only (the others get {}) unless every node writes (save.on_each_node)."""
        from kiln.strategies.fsdp.checkpoint_io import full_model_state

        every_rank = bool(self.config.save.on_each_node) if self.config is not None else False
        return full_model_state(self.unwrap(module), every_rank=every_rank)

    def teardown(self) -> None:
        self.device_mesh, self._dp_group, self._root, self._loss_parallel = None, None, None, None
        super().teardown()


@contextlib.contextmanager
def _all_of(contexts: list[ContextManager[Any]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def _is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)
