"""The training step as one CUDA graph: the host out of the loop.

    graph = step_graph(cfg, ctx)                  # None: runtime.cuda_graphs is off or the run does not qualify
    host = [take_micro(...) for _ in range(M)]    # the step's micro-batches on the host, tokens counted
    if graph.ready(host): parts = graph.replay(host, lr)    # one launch for the whole step
    elif graph.capture_now(host): parts = graph.capture(host, lr, body)

A step at a fixed shape launches the same kernels every time: the micro-batches' forward passes (teacher
and student), the KD head, the backward passes, gradient clipping, the non-finite test and the fused
AdamW update. At batch 4 x 2048 the host needs as long to queue them as the GPU needs to run them, so
the GPU waits for Python. After prewarm and two eager steps (the optimizer's state exists, every Triton
binary is loaded, so capture compiles nothing), the device work of one step is captured once and then
replayed: per step the host copies the batch into the graph's input buffers, writes the learning rate
into a device scalar, replays, and reads back the logged values once, as the eager step does.

What the graph holds is fixed at capture: the batch shape, each micro-batch's count of scored tokens
(the loss divides by it, and the KD head gathers exactly that many rows), and the buffers every kernel
reads and writes, the gradients included. A step whose shape or token counts differ from the captured
ones runs eagerly (the gradients stay the graph's tensors: zeroed in place, not freed), and so does a
step a test hook poisons with a NaN loss. Everything the eager step decides on the device it still
decides on the device: the non-finite test feeds AdamW's `found_inf`, which skips the update inside the
kernel, and clipping scales the gradients by a device scalar.

`auto` (runtime.cuda_graphs) captures on a CUDA device, in one process (or, generated steps, under
torchrun with a whole student: below), with live teachers and no layer map, teacher cache or
cross-tokenizer teacher; LoRA adapters are captured too (their dropout draws from
the CUDA generator, which a replay advances as the eager step would); `on` asks for it and is refused in
one line where it cannot be done; `off` never captures. The replayed step's losses equal the eager step's
bit for bit (tests/gpu: twenty steps).

Generated steps (kd.on_policy / kd.seq_kd, when every step is one, scored by one teacher with the
divergence loss): the completions are written and the teacher scores them eagerly, as before; what is
captured is the update, from the rows (input ids, labels) and the teacher's final hidden states, copied
into the graph's buffers, to AdamW. Completions differ in length from step to step, so its KD head
computes a fixed number of rows, the most completion tokens a micro-batch can hold (OnPolicy.head_rows),
the rows past the labels' count ignored and the sums divided by the count on the device
(kdistill.ops.kd_loss's `rows`): one signature for every step of the run. A step whose completion tokens
fill less than half of those rows (rows stopped early, as reasoning-length runs have them) runs eagerly
with its labels counted on the host instead: the ignored rows' GEMMs would cost more than the graph
saves. A run that captures its generated steps computes them in that form on its eager steps too, so a
replay equals an eager step bit for bit; against a run that does not capture, the losses agree up to
rounding. The teacher's scoring forward is captured too, in graphs of its own (`ScoringGraphs`), in one
process and under torchrun alike.

Under torchrun a run captures its generated steps when the student and the teacher are whole on every
process (runtime.student_placement, memory.Layout.student_replicated): the update's collectives (the
logged means summed over the processes, the gradients averaged: distributed.GradAverage) are captured
with it, and each micro-batch's loss weight, its share of every process's completion tokens, is one
more input buffer. A sharded (FSDP2) student's step is never captured: its collectives and hooks run on
the host. Data steps under torchrun stay eager.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from kdistill.config import RunConfig
from kdistill.errors import UserError
from kdistill.memory import capture_blocker
from kdistill.train import faults

log = logging.getLogger("kdistill")

WARM_STEPS = 2  # eager steps at the captured signature first: optimizer state, binaries, allocator


def wanted(cfg: RunConfig, device: torch.device, world: int, replicated: bool = False) -> bool:
    """Whether the run captures its step: runtime.cuda_graphs, checked against what the run does
    (replicated: under torchrun, a whole student and teacher on every process). `on` where capture
    cannot be done is a one-line UserError."""
    mode = cfg.runtime.cuda_graphs
    if mode == "off":
        return False
    why = capture_blocker(cfg, device.type, world, replicated)
    if why is None:
        return True
    if mode == "on":
        raise UserError(f"runtime.cuda_graphs is 'on' but {why}; use auto or off")
    return False


def signature(host: list[tuple[tuple[torch.Tensor, ...], int | None]], kind: str = "data") -> tuple:
    """What a captured step depends on: its kind (a data step, or a generated one: on_policy, seq_kd),
    each micro-batch's tensor shapes and scored-token count (a generated step's: the KD head's fixed
    row count, whatever its completions' lengths)."""
    return (kind, *((tuple(tuple(t.shape) for t in tensors), n) for tensors, n in host))


class ScoringGraphs:
    """A captured run's scoring of generated rows: the teacher's forward over a micro-batch of them (its
    final hidden states, without grad), captured once per input shape after WARM_STEPS eager calls at it
    and replayed. Eager, that forward of a 1.5B teacher over 8 x 256 tokens queues ~600 kernels for
    ~10 ms of device work and takes ~25 ms (NOTES.md round twenty-one): the host's time, which also
    varies from process to process under torchrun, where every process waits for the slowest. The
    replay reads the rows from a static input buffer and its hidden states are copied out (the next
    micro-batch's replay overwrites them); the graph's pool, one forward's transients, stays allocated
    (memory.generation_beside_graph_pool). Under torchrun the graphs must be gone before the process
    group is: runs whose graphs were still alive then hung in `destroy_process_group` (NOTES.md round
    twenty-two), so every run releases them first (`StepGraph.release`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.seen: dict[tuple, int] = {}
        self.counts = {"scoring_captures": 0, "scoring_replays": 0}

    def __call__(self, teacher: torch.nn.Module, ids: torch.Tensor, amp: Any) -> torch.Tensor:
        """The teacher's final hidden states (B, T, H) of rows `ids` (B, T), replayed, captured or eager."""
        key = (id(teacher), tuple(ids.shape))
        held = self.graphs.get(key)
        if held is None:
            if self.seen.get(key, 0) < WARM_STEPS or faults.capture_held():
                self.seen[key] = self.seen.get(key, 0) + 1
                with torch.no_grad(), amp:
                    return teacher(ids)
            inputs = ids.clone()
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), amp, torch.cuda.graph(graph):
                out = teacher(inputs)
            held = self.graphs[key] = (graph, inputs, out)
            self.counts["scoring_captures"] += 1
        graph, inputs, out = held
        inputs.copy_(ids)
        graph.replay()
        self.counts["scoring_replays"] += 1
        return out.clone()

    def release(self) -> None:
        """Destroy the captured graphs (their counts stay for the summary)."""
        for graph, _, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()


class StepGraph:
    """One captured training step and its static buffers (see the module docstring).

    lr: the learning rate as a device scalar; the step's fused AdamW reads it (eager steps too, so the
    captured and eager updates run the same kernel on the same operands)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.graph: torch.cuda.CUDAGraph | None = None
        self.sig: tuple | None = None
        self.last_sig: tuple | None = None
        self.seen = 0  # eager steps in a row at last_sig
        self.inputs: list[tuple[torch.Tensor, ...]] = []  # per micro-batch, on the device
        self.parts: torch.Tensor | None = None  # the captured step's read-back values
        self.grads: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self.counts = {"captures": 0, "replays": 0, "eager_steps": 0}
        self.scoring = ScoringGraphs(device)  # a generated step's teacher forward (its own graphs)

    def ready(self, sig: tuple) -> bool:
        return self.graph is not None and sig == self.sig

    def note_eager(self, sig: tuple) -> None:
        """An eager step at `sig` is about to run (WARM_STEPS of them in a row, and the next one at `sig`
        is captured)."""
        self.counts["eager_steps"] += 1
        self.seen = self.seen + 1 if sig == self.last_sig else 1
        self.last_sig = sig

    def capture_now(self, sig: tuple) -> bool:
        held = faults.capture_held()  # a test's reference run: every step eager, in the captured form
        return self.graph is None and sig == self.last_sig and self.seen >= WARM_STEPS and not held

    def load(self, host: list[tuple[tuple[torch.Tensor, ...], int | None]]) -> None:
        """Copy the step's host batches into the graph's input buffers (no wait for the GPU: the host
        tensors are pinned first, so the copies are queued on the stream)."""
        for bufs, (tensors, _) in zip(self.inputs, host, strict=True):
            for buf, t in zip(bufs, tensors, strict=True):
                buf.copy_(t.pin_memory() if t.device.type == "cpu" else t, non_blocking=True)

    def capture(
        self,
        host: list[tuple[tuple[torch.Tensor, ...], int | None]],
        opt: torch.optim.Optimizer,
        model: torch.nn.Module,
        body: Callable[[list[tuple[torch.Tensor, ...]]], torch.Tensor],
        sig: tuple | None = None,
    ) -> torch.Tensor:
        """Capture `body(inputs) -> parts` (the step's device work on the static input buffers) and
        replay it once for this step. The gradients are freed first, so the captured backward writes
        them into the graph's memory, where they then stay. sig: the step's signature (default: a data
        step's, from `host`)."""
        sig = signature(host) if sig is None else sig
        self.inputs = [
            tuple(torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in tensors)
            for tensors, _ in host
        ]
        self.load(host)
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(self.device)
        # The eager steps' blocks go back to the driver: the graph's private pool takes their place
        # rather than adding to them.
        torch.cuda.empty_cache()
        groups = opt.param_groups
        for g in groups:
            g["capturable"] = True  # AdamW's capture check; the fused kernel is the same either way
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                parts = body(self.inputs)
        finally:
            for g in groups:
                g["capturable"] = False
        self.graph, self.sig, self.parts = graph, sig, parts
        self.grads = [(p, p.grad) for p in model.parameters() if p.grad is not None]
        self.counts["captures"] += 1
        log.info("training step captured as a CUDA graph (%d micro-batches)", len(host))
        graph.replay()
        self.counts["replays"] += 1
        return parts

    def replay(self, host: list[tuple[tuple[torch.Tensor, ...], int | None]]) -> torch.Tensor:
        self.load(host)
        assert self.graph is not None and self.parts is not None
        self.graph.replay()
        self.counts["replays"] += 1
        return self.parts

    def restore_grads(self) -> bool:
        """Before an eager step after capture: the parameters' gradients are the graph's tensors again,
        zeroed in place (the eager backward accumulates into them; freeing them would leave the graph's
        copies allocated beside new ones). False before capture: the eager step frees them as usual."""
        if self.graph is None:
            return False
        with torch.no_grad():
            for p, g in self.grads:
                p.grad = g
                g.zero_()
        return True

    def release(self) -> None:
        """At the end of a run, before the process group is destroyed: destroy every captured graph. A
        graph that captured NCCL collectives holds its communicator (NCCL's persistent plans are
        reclaimed when the graph is destroyed), and destroying the communicator first waits for that:
        a run under torchrun whose graphs were still alive hung in `destroy_process_group` after its
        last step (NOTES.md round twenty-two). Their counts stay for the summary."""
        if self.device.type == "cuda" and (self.graph is not None or self.scoring.graphs):
            torch.cuda.synchronize(self.device)
        if self.graph is not None:
            self.graph.reset()
        self.graph, self.sig, self.parts = None, None, None
        self.inputs, self.grads = [], []
        self.scoring.release()

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counts)
        if self.scoring.counts["scoring_captures"] or self.scoring.counts["scoring_replays"]:
            out.update(self.scoring.counts)
        return out
