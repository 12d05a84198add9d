"""Data-parallel training over several processes (torchrun) with FSDP2.

    torchrun --nproc_per_node=8 -m kdistill run run.yaml

`init_from_env` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK): NCCL on CUDA (one GPU per
process, chosen by LOCAL_RANK), gloo on the CPU. Without WORLD_SIZE (or with WORLD_SIZE=1) nothing is
initialised and every helper here is a no-op, so a single process runs exactly the code it always ran.

What is sharded (FSDP2, `fully_shard`): every decoder block of the student (`model.model.layers[i]`, a
self-contained `Block` whose forward the decoder calls) as one unit, then the root, which holds the
embeddings, the final norm and the lm_head. On a GPU the student's units gather their parameters in the
compute dtype and reduce gradients in fp32 (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`;
the fp32 masters and AdamW state stay sharded). Each block prefetches the next block's all-gather in
forward. With `keep_gathered` (memory.Layout.student_kept, runtime.student_reshard) the blocks stay
gathered until their backward, which then gathers nothing, and a full-weight (not LoRA) student's blocks
are sharded a few consecutive blocks to a unit (memory.student_unit_blocks: fewer collectives a step);
otherwise each is freed after its forward and prefetches the previous block's all-gather in backward. The root is not resharded after forward (FSDP2's rule for
the root), so the KD head reads the gathered lm_head for every chunk and in its backward without another
all-gather: the root's weights are gathered once per micro-batch. The teacher (runtime.teacher_placement)
is sharded the same way (frozen, blocks resharded after forward, the root after the loss's backward) or
replicated whole on every process (no gathers at all).

A whole student on every process (runtime.student_placement=replicate, memory.Layout.student_replicated):
nothing of it is sharded; each process computes its gradients on its rows and `GradAverage` averages them
with one all-reduce of one flat buffer a step (every process then updates the same weights with the same
AdamW); the teacher beside it is whole too. Checkpoints are then DCP's too, every tensor written once.

Gradients: each process takes its slice of every global batch and computes the loss as a mean over its own
tokens; FSDP's reduce-scatter averages gradients over the processes. `loss_weight` scales each process's
loss by its share of the batch's tokens (n_rank * world / n_total), so the averaged gradient equals the
gradient of the single-process loss over the whole batch (up to float rounding); with equal token counts
the weight is exactly 1.

Checkpoints under torchrun are sharded (`torch.distributed.checkpoint`): `save_sharded` has every process
write its own shards of the student and its AdamW state, nothing is gathered; `load_sharded` reads them
back into a model sharded over any number of processes, or into a plain model in one process (DCP
reshards by tensor name and offsets). A one-process checkpoint holds full tensors (safetensors):
`load_full_state` puts them into a sharded model and optimizer. So a run saved on N processes resumes on
M. The exported student is gathered once (`unsharded_copy`). Modules that train beside the student outside
its decoder (kd.layer_map's projections, attached after sharding) are FSDP2 units of their own
(`shard_beside`), so their gradients are averaged and their state sharded like the student's.

A LoRA student (`student.lora`) is sharded the same way, the frozen base and the fp32 adapters of a block in
one unit, but without FSDP's mixed precision: every unit gathers its parameters in the dtypes they are
stored in (the base in `student.lora.base_dtype`, the adapters in fp32), which is what one process computes
with and what the kernel plan expects of a LoRA student (see `shard_student`). Only the adapters (and
kd.layer_map's projections) have gradients, AdamW state and a place in the sharded checkpoints: the frozen
base is student.path's weights, read again on resume. The adapters are gathered once at the end
(`full_model_state(trainable_only=True)`) for rank 0 to write PEFT's adapter directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from kdistill.decode import dense_linear, full_value
from kdistill.errors import UserError
from kdistill.memory import student_unit_blocks
from kdistill.models.decoder import KD_ONLY_PREFIX, build_decoder
from kdistill.models.lora import has_lora
from kdistill.train import faults

log = logging.getLogger("kdistill")


@dataclasses.dataclass(frozen=True)
class DistInfo:
    rank: int
    world: int
    local_rank: int
    device: torch.device | None  # the device of this process (cuda:LOCAL_RANK on CUDA); None: unchanged


_INFO = DistInfo(0, 1, 0, None)


def info() -> DistInfo:
    """This process's place (rank 0 of 1 when not distributed)."""
    return _INFO


def active() -> bool:
    return _INFO.world > 1


def is_main() -> bool:
    return _INFO.rank == 0


def init_from_env(device_type: str) -> DistInfo:
    """Initialise the process group from torchrun's environment; world 1 (no-op) when WORLD_SIZE is unset."""
    global _INFO
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        _INFO = DistInfo(0, 1, 0, None)
        return _INFO
    if dist.is_initialized():
        return _INFO
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = None
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise UserError("runtime.device is cuda, but no CUDA GPU is available (use runtime.device=cpu)")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    timeout = datetime.timedelta(minutes=30)
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout, "rank": rank, "world_size": world}
    if device is not None:
        kwargs["device_id"] = device
    # torchrun's own store (env://), its keys kept apart per restart attempt: torchrun keeps the store of
    # a job across --max-restarts, and a restarted process must not read the address a process of the
    # failed attempt published (it would try to connect to a process that is gone).
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    dist.init_process_group(store=dist.PrefixStore(f"kdistill/attempt-{attempt}", store), **kwargs)
    _INFO = DistInfo(rank, world, local_rank, device)
    global _JOINED
    _JOINED = True
    # FSDP2 warns, on every run, that a block returns a view (its MLP output, a reshaped matmul): an
    # in-place op on it would skip the block's pre-backward all-gather. The decoder only reads a block's
    # outputs (out-of-place kernels), and the 2-process runs match one process's gradients (tested).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPBlock\) returned a view tensor")
    return _INFO


_JOINED = False  # this process initialised a process group (init_from_env)


def joined() -> bool:
    """Whether this process ever joined a process group (it may have been destroyed since)."""
    return _JOINED


def leave(code: int) -> NoReturn:
    """End a process that joined a process group: flush what it printed and exit with `code` without
    the interpreter's finalisation.

    Why: the backend's C++ threads (gloo's workers) can still be dropping their last references to
    tensors that Python objects own when the interpreter shuts down; such a thread then takes the GIL
    after finalisation began, which ends the process with SIGABRT ("terminate called without an active
    exception") after a run that completed. Every file of the run is closed by then (written through
    temporary files and renamed), so nothing is lost by skipping finalisation."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)


TEARDOWN_S = 60.0  # the most a process waits for its process group's teardown (normally < 1 s)
TEARDOWN_LATE = "the process group's teardown did not end within"  # the warning's words (benchmarks count it)


def destroy(timeout: float = TEARDOWN_S) -> bool:
    """Leave the process group (if any). The teardown runs in a thread of its own and is waited for at
    most `timeout` seconds: NCCL's communicator destruction waits for every CUDA graph that captured its
    collectives to be destroyed, and a run that had finished (every file written) once hung there for
    good (NOTES.md round twenty-two). Past the timeout a warning says so and False is returned; the
    process then ends through `leave` (the CLI's way out of a torchrun job), which does not wait for
    that thread. An error of the teardown itself is raised here."""
    global _INFO
    finished = True
    if dist.is_initialized():
        # a CUDA graph that captured collectives and is still alive (held in a reference cycle) would
        # make the communicator's destruction wait for it: collect such garbage first
        gc.collect()
        device, failed = _INFO.device, []
        hang = faults.teardown_hang()
        timeout = timeout if hang is None else hang

        def teardown() -> None:
            if hang is not None:  # a test's teardown that never ends
                threading.Event().wait()
            try:
                if device is not None and device.type == "cuda":
                    torch.cuda.set_device(device)  # this thread's device: the communicator's
                dist.destroy_process_group()
            except BaseException as e:  # raised again by the waiting thread
                failed.append(e)

        worker = threading.Thread(target=teardown, name="kdistill-teardown", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            finished = False
            log.warning(
                "%s %g s; the run's files are complete: leaving without it",
                TEARDOWN_LATE,
                timeout,
            )
        elif failed:
            raise failed[0]
    _INFO = DistInfo(0, 1, 0, None)
    return finished


def barrier() -> None:
    if active():
        dist.barrier()


def _comm_device() -> torch.device:
    return _INFO.device if _INFO.device is not None else torch.device("cpu")


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum over processes of a few floats (float64); unchanged when not distributed."""
    if not active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def run_on_main(fn: Callable[[], Any]) -> Any:
    """Run fn on rank 0 only; a UserError there is raised on every process (so none waits forever)."""
    if not active():
        return fn()
    result, error = None, None
    if is_main():
        try:
            result = fn()
        except UserError as e:
            error = str(e)
        except BaseException as e:
            error = f"rank 0 failed: {e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            box = [error]
            dist.broadcast_object_list(box, src=0)
            raise
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise UserError(box[0])
    return result


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block first (e.g. to fill a cache), then the others; errors reach every process."""
    if not active():
        yield
        return
    if is_main():
        error = None
        try:
            yield
        except UserError as e:
            error = str(e)
            raise
        except BaseException as e:
            error = f"rank 0 failed: {e.__class__.__name__}"
            raise
        finally:
            box = [error]
            dist.broadcast_object_list(box, src=0)
    else:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise UserError(box[0])
        yield


def check_divisible(batch_size: int, world: int) -> None:
    """A global batch splits evenly over the processes, or a one-line error."""
    if batch_size % world:
        raise UserError(
            f"schedule.batch_size {batch_size} is not divisible by the {world} processes (torchrun nproc)"
        )


def env_world() -> int:
    """torchrun's WORLD_SIZE (1 without torchrun), read before any process group is joined."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def batch_slice(batch_size: int) -> slice:
    """The rows of a global batch that this process trains on."""
    world, rank = _INFO.world, _INFO.rank
    check_divisible(batch_size, world)
    per = batch_size // world
    return slice(rank * per, (rank + 1) * per)


def loss_weight(tokens: int, total: int) -> tuple[float, int]:
    """(scale for this process's mean loss, tokens over all processes) from this process's scored
    tokens and those of the whole global batch (which every process reads: see the module docstring)."""
    if total == 0:
        return 1.0, 0
    return tokens * _INFO.world / total, total


def all_gather_floats(values: list[float]) -> list[list[float]]:
    """Every process's few floats (as many on each), in rank order, on every process: one all-gather of
    a float64 tensor on the backend's device; [values] when not distributed."""
    if not active():
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    everyone = torch.empty(_INFO.world * len(values), dtype=torch.float64, device=mine.device)  # flat: gloo
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name first
    gather(everyone, mine)
    return everyone.view(_INFO.world, len(values)).tolist()


def all_gather_object(obj: Any) -> list[Any]:
    """Every process's `obj` (JSON-like: lists, numbers), in rank order, on every process; [obj] alone."""
    if not active():
        return [obj]
    out: list[Any] = [None] * _INFO.world
    dist.all_gather_object(out, obj)
    return out


def all_reduce_tensor(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over processes in place, on its device, without waiting for it (unchanged when not
    distributed)."""
    if active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


class GradAverage:
    """A replicated student's gradients averaged over the processes (runtime.student_placement=replicate):
    copied into one flat buffer in `dtype` (fp32, or the compute dtype for half the link's bytes, as
    runtime.grad_reduce asks), one all-reduce of it, and copied back (every process then holds the same
    gradients, so the same AdamW keeps every copy of the student equal). The buffer is allocated at the
    first call and kept: a captured step (kdistill.train.graph) reads and writes the same memory as the
    eager steps, and its all-reduce is captured with it (NCCL collectives are capturable). Each process's
    loss is weighted as under FSDP2 (`loss_weight`), so the average is the one-process gradient."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.flat: torch.Tensor | None = None
        self.sizes: list[int] = []

    def __call__(self, model: torch.nn.Module) -> None:
        if not active():
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return
        sizes = [g.numel() for g in grads]
        if self.flat is None or sizes != self.sizes or self.flat.device != grads[0].device:
            self.flat = torch.empty(sum(sizes), dtype=self.dtype, device=grads[0].device)
            self.sizes = sizes
        views = [v.view_as(g) for v, g in zip(self.flat.split(sizes), grads, strict=True)]
        torch._foreach_copy_(views, grads)  # cast to the reduce dtype on the way
        if self.flat.device.type == "cuda":
            dist.all_reduce(self.flat, op=dist.ReduceOp.AVG)
        else:  # gloo has no AVG: the sum, divided (exact for a power-of-two world)
            dist.all_reduce(self.flat, op=dist.ReduceOp.SUM)
            self.flat.div_(_INFO.world)
        torch._foreach_copy_(grads, views)


# ----------------------------------------------------------------------------------------------
# Sharding
# ----------------------------------------------------------------------------------------------
def _shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP units below the root: the decoder blocks, in order."""
    return list(model.model.layers)  # type: ignore[union-attr]


def _mesh() -> DeviceMesh:
    return init_device_mesh(_comm_device().type, (_INFO.world,))


def _prefetch(root: torch.nn.Module, units: list[torch.nn.Module], backward: bool) -> None:
    """Explicit prefetch: the root and each block issue the next block's all-gather as soon as their own
    is copied out; in backward each block issues the previous one's (FSDP2's `set_modules_to_*`)."""
    if not units:
        return
    root.set_modules_to_forward_prefetch([units[0]])  # type: ignore[operator]
    for i, unit in enumerate(units):
        if i + 1 < len(units):
            unit.set_modules_to_forward_prefetch([units[i + 1]])  # type: ignore[operator]
        if backward and i > 0:
            unit.set_modules_to_backward_prefetch([units[i - 1]])  # type: ignore[operator]


def shard_student(
    model: torch.nn.Module,
    compute_dtype: torch.dtype = torch.float32,
    keep_gathered: bool = False,
    reduce_dtype: torch.dtype = torch.float32,
    unit_blocks: int | None = None,
) -> torch.nn.Module:
    """FSDP2: the decoder blocks, then the root (embeddings, final norm, lm_head). compute_dtype other
    than fp32: parameters gathered in it, gradients reduced in fp32; block inputs keep their dtypes (the
    residual stream stays as the decoder makes it). A LoRA student's parameters are gathered as stored.
    keep_gathered (memory.Layout.student_kept): the blocks stay gathered from their forward to their
    backward (`reshard_after_forward=False`), so the backward gathers nothing. reduce_dtype
    (runtime.grad_reduce): fp32, or the compute dtype for half the reduce-scatter's bytes. unit_blocks
    (runtime.student_unit_blocks): consecutive blocks sharded as one unit (one all-gather and one
    reduce-scatter for them all); None or 0: memory.student_unit_blocks (one, or a few units for a kept
    student that is not LoRA)."""
    mesh = _mesh()
    kwargs: dict[str, Any] = {"mesh": mesh}
    # A LoRA student: the same units (a block's frozen base linears, its norms and its trainable adapters
    # together), no mixed-precision policy. FSDP2 handles frozen and trainable parameters in one unit (it
    # reduce-scatters only the parameters that have gradients) and, from torch 2.8, frozen parameters in
    # another dtype than the trainable ones (a bf16 base beside fp32 adapters: the unit is all-gathered
    # as bytes, each parameter keeping its dtype); it still needs one dtype among the trainable ones, which
    # the fp32 adapters have. Why no `param_dtype`: casting at the gather would change what the base
    # computes with (an fp32 base's norms in bf16) and the adapters' master copies (bf16 adapters,
    # gradients), unlike one process and unlike the kernel plan (`kernels.plan.precision`: a LoRA student's
    # layers see its base_dtype, sharded or not). A run that wants bf16 gathers stores the base in bf16
    # (student.lora.base_dtype=bfloat16): half the memory and half the traffic, and the same numbers as
    # one process. Gradients are the fp32 adapters' own, reduced in fp32 without a reduce_dtype.
    if compute_dtype != torch.float32 and not has_lora(model):
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=compute_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
        )
    units = _shard_units(model)
    per = student_unit_blocks(len(units), keep_gathered, has_lora(model), unit_blocks or 0)
    for i in range(0, len(units), per):
        group = units[i : i + per]
        fully_shard(group if len(group) > 1 else group[0], reshard_after_forward=not keep_gathered, **kwargs)
    # The root keeps its gathered parameters after forward in either case (FSDP2's default for a root):
    # the KD head reads the lm_head after the decoder's forward and again in its backward.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    if per == 1:  # units of several blocks: FSDP2's own order (as measured, memory.student_unit_blocks)
        _prefetch(model, units, backward=not keep_gathered)
    return model


def shard_beside(module: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 for a module that trains beside the sharded student but outside its decoder (one of
    kd.layer_map's projections, attached after `shard_student`): its own unit, gathered in the dtype it
    is stored in (fp32, as one process computes it: the layer loss runs outside autocast), its gradient
    reduce-scattered with the student's. Unsharded, its gradient would differ by process (each its own
    rows) and clipping would mix DTensor and plain gradients."""
    fully_shard(module, mesh=_mesh())
    return module


def shard_teacher(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 for the frozen teacher: the same units, each resharded right after its forward."""
    mesh = _mesh()
    units = _shard_units(model)
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    # The root keeps its gathered parameters after forward: the KD head reads the teacher's lm_head after
    # the forward and again in its backward; the loop calls `reshard` once the backward is done.
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    _prefetch(model, units, backward=False)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` is an FSDP2 root (its parameters are shards: a forward gathers them, collectively)."""
    return isinstance(model, FSDPModule)


@torch.no_grad()
def gathered_copy(model: torch.nn.Module, into: torch.nn.Module | None = None) -> torch.nn.Module:
    """A plain Decoder on this process's device holding a sharded model's whole weights, on every process
    (collective: each parameter is all-gathered, in the same order everywhere). A LoRA model's adapters
    are merged into its linears (W + scaling B A, as the decode engine's weights); distillation-only
    `kd_` modules are left out. `into`: the copy an earlier call returned, refreshed in place.

    Why a copy: a forward of the sharded model gathers every unit, a collective, so processes that
    generate different numbers of tokens would wait on each other forever; the copy's forwards have no
    collective at all."""
    body = model.model  # type: ignore[union-attr]
    embed = full_value(body.embed_tokens.weight)  # (V, H): its dtype and device make the copy's
    copy = into
    if copy is None:
        copy = build_decoder(model.spec, device=embed.device, dtype=embed.dtype, seed=None)  # type: ignore[arg-type]
    source = dict(model.named_modules())
    for name, module in copy.named_modules():
        if name == "model.embed_tokens":
            module.weight.copy_(embed)
        elif isinstance(module, torch.nn.Linear):
            weight, bias = dense_linear(source[name])
            module.weight.copy_(weight)
            if module.bias is not None and bias is not None:
                module.bias.copy_(bias)
        else:
            for pname, p in module.named_parameters(recurse=False):
                p.copy_(full_value(getattr(source[name], pname)))
    return copy


def check_lora_sharding(base_dtype: torch.dtype) -> None:
    """Refuse, before anything loads, a LoRA student that this torch's FSDP2 cannot shard: a base in
    another dtype than the fp32 adapters needs torch 2.8 (earlier FSDP2 wants one dtype per unit)."""
    if base_dtype != torch.float32 and torch.__version__ < (2, 8):  # type: ignore[operator]
        name = str(base_dtype).removeprefix("torch.")
        raise UserError(
            f"student.lora.base_dtype={name} under torchrun needs torch >= 2.8 (this is {torch.__version__}): "
            f"the FSDP2 of earlier versions shards a decoder block only if all its parameters share one "
            f"dtype, and the block holds the {name} base and the float32 adapters; upgrade torch or use "
            "student.lora.base_dtype=float32"
        )


def unshard(model: torch.nn.Module) -> None:
    """Gather every FSDP unit of a sharded model now (FSDP2's own all-gathers, one per unit, in the
    compute dtype), all issued before the first is waited on. The parameters stay gathered until FSDP
    frees them: its next forward gathers nothing (collective: every process calls it)."""
    handles = [m.unshard(async_op=True) for m in model.modules() if isinstance(m, FSDPModule)]
    for handle in handles:
        if handle is not None:
            handle.wait()


def reshard(model: torch.nn.Module) -> None:
    """Free the gathered parameters a forward without backward left behind: the root's (FSDP2 keeps
    them after forward) and, with the student's blocks kept gathered until backward, the blocks'."""
    if getattr(model, "reshard", None) is None:
        return
    for module in model.modules():
        fn = getattr(module, "reshard", None)
        if isinstance(module, FSDPModule) and fn is not None:
            fn()


# ----------------------------------------------------------------------------------------------
# Full state dicts (checkpoints, export)
# ----------------------------------------------------------------------------------------------
def _options(**kwargs: Any) -> StateDictOptions:
    return StateDictOptions(full_state_dict=True, cpu_offload=True, **kwargs)


def _has_frozen(model: torch.nn.Module) -> bool:
    """True for a model with frozen parameters (a LoRA student's base): its state dicts leave them out."""
    return any(not p.requires_grad for p in model.parameters())


def _param_names(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """Names of the optimizer's parameters in its own order (the integer ids of opt.state_dict())."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in opt.param_groups for p in g["params"]]


def full_model_state(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The model's full state dict on the CPU on rank 0 (empty elsewhere). Every process must call it.
    trainable_only: the parameters that train, e.g. a LoRA student's adapters (only these are gathered)."""
    return get_model_state_dict(model, options=_options(ignore_frozen_params=trainable_only))


class FullState:
    """A stand-in with `state_dict()` for the checkpoint writer (which calls module/optimizer.state_dict())."""

    def __init__(self, sd: dict[str, Any]) -> None:
        self._sd = sd

    def state_dict(self) -> dict[str, Any]:
        return self._sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:  # receives what the checkpoint reader builds
        self.loaded = sd


def load_full_state(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    weights: dict[str, torch.Tensor],
    opt_state: dict[str, Any],
) -> None:
    """Load full tensors (every process holds them) into the sharded model and optimizer.

    opt_state is in opt.state_dict()'s format (integer ids), as a single process writes it. A model with
    frozen parameters (a LoRA student) takes `weights` of its trainable ones; the frozen ones stay.
    """
    set_model_state_dict(model, weights, options=_options(strict=not _has_frozen(model)))
    names = _param_names(model, opt)
    osd = {
        "state": {names[int(i)]: st for i, st in opt_state["state"].items()},
        "param_groups": [
            {**g, "params": [names[int(i)] for i in g["params"]]} for g in opt_state["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, opt, osd, options=_options())


def _sharded_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and optimizer's state by parameter name: this process's shards (DTensors) under FSDP2,
    plain tensors in one process. A fresh optimizer's state is created (zeros) so that it can be loaded.
    Frozen parameters (a LoRA student's base) are left out: the run reads them from student.path."""
    model_sd = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    return {"model": model_sd, "optim": get_optimizer_state_dict(model, opt)}


def sharded_model_names(path: str) -> set[str]:
    """Names of the model tensors in a `save_sharded` folder (its DCP metadata; no tensor is read).
    Metadata that does not read is a ValueError (a damaged checkpoint)."""
    try:
        names = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as e:  # whatever a damaged file makes DCP's reader raise
        raise ValueError(f"unreadable checkpoint metadata ({e.__class__.__name__})") from None
    return {k.removeprefix("model.") for k in names if k.startswith("model.")}


def save_sharded(model: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    """Write the student and its optimizer state to the folder `path`, every process its own shards
    (collective under torchrun; DCP's files plus its .metadata)."""
    dcp.save(_sharded_state(model, opt), checkpoint_id=path)


def load_sharded(model: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    """Read a `save_sharded` folder into this model and optimizer, sharded over any number of processes
    or plain in one (collective under torchrun). A tensor of the model that the folder lacks is a
    ValueError naming it."""
    state = _sharded_state(model, opt)
    saved = sharded_model_names(path)
    missing = sorted(k for k in state["model"] if k not in saved)
    if missing:
        raise ValueError(f"missing tensor {missing[0]!r}")
    with warnings.catch_warnings():  # one process: DCP says it assumes one process, as intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path)
    # not strict for a LoRA student: its frozen base is in no checkpoint
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not _has_frozen(model)))
    set_optimizer_state_dict(model, opt, state["optim"])


def unsharded_copy(model: torch.nn.Module) -> torch.nn.Module | None:
    """A plain CPU Decoder with the sharded model's full weights on rank 0 (None elsewhere); collective.
    Distillation-only modules (`kd_`, e.g. kd.layer_map's projections) are left out, as every export does."""
    sd = full_model_state(model)
    if not is_main():
        return None
    sd = {k: v for k, v in sd.items() if not k.startswith(KD_ONLY_PREFIX)}
    dtype = next(iter(sd.values())).dtype
    plain = build_decoder(model.spec, device="cpu", dtype=dtype, seed=None)  # type: ignore[arg-type]
    plain.load_state_dict(sd)
    return plain
