"""One optimizer step, as train_accel.py and the ladder's full-recipe rung both run it."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import Tensor

from training.checkpoint import TrainProgress, list_checkpoints
from training.distributed import clip_grad_norm, is_dtensor

Batches = Iterator[tuple[Tensor, Tensor]]


class TrainingAborted(RuntimeError):
    """The run stops for `why`, naming its last good checkpoint (None: none saved yet) to continue from."""

    def __init__(self, why: str, last_good: Path | None) -> None:
        super().__init__(
            f"{why}; aborting. Last good checkpoint: {last_good or 'none yet'}. Lower --lr or raise --warmup-steps"
            + (f", then continue with --resume {shlex.quote(str(last_good))}" if last_good else "")
        )


def is_out_of_memory(err: BaseException) -> bool:
    """A failed allocation: torch.OutOfMemoryError on accelerators, a RuntimeError from the allocator on the CPU."""
    return isinstance(err, torch.OutOfMemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(err)


@dataclass
class StepOutput:
    loss: Tensor  # this rank's mean loss over the step's micro-batches, detached, on the device
    grad_norm: Tensor  # global norm before clipping, on the device


def masks_on_device(accelerator: Accelerator, optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer can skip a non-finite update on the device (fused AdamW's found_inf): plain-tensor
    parameters, no fp16 GradScaler (it owns found_inf) and not DeepSpeed (which steps inside its own engine)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return (
        getattr(inner, "_step_supports_amp_scaling", False)
        and accelerator.scaler is None
        and accelerator.distributed_type != DistributedType.DEEPSPEED
        and not any(is_dtensor(p) for group in inner.param_groups for p in group["params"])
    )


class Trainer:
    """train_step() does one optimizer step: grad_accum micro-batches under accelerator.accumulate, backward, clip,
    the finiteness check, the update. A step with non-finite gradients changes no weight and no counter.

    Under fp16 the GradScaler skips such an update itself and lowers its loss scale: an overflow of the scaled
    gradients (the loss finite, the scale above 1) is that calibration, reported but not counted toward
    max_bad_steps. A non-finite loss, or an overflow at a scale of 1 or less (the gradients overflow unscaled, where
    DeepSpeed's min_loss_scale stops too), counts as under bf16 and fp32.

    Where the optimizer can mask its update on the device, the host reads a step's verdict (non-finite? stop
    requested on any rank?) one step late, while the next step's backward runs, instead of stalling the GPU at
    every step; settle() reads it at once (before logging, evals, checkpoints). Elsewhere it is read at once."""

    def __init__(
        self,
        accelerator: Accelerator,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        *,
        grad_accum: int = 1,
        grad_clip: float,
        tokens_per_step: int,
        max_bad_steps: int = 1,
        progress: TrainProgress | None = None,
        stop: Callable[[], bool] = lambda: False,
        run_dir: Path | None = None,  # where the last good checkpoint is named from when aborting
        resumed_from: Path | None = None,  # the checkpoint this launch continued from: the last good one till then
    ) -> None:
        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.grad_accum, self.grad_clip, self.tokens_per_step = grad_accum, grad_clip, tokens_per_step
        self.max_bad_steps, self.stop, self.run_dir, self.resumed_from = max_bad_steps, stop, run_dir, resumed_from
        self.progress = progress or TrainProgress()
        self.masks = masks_on_device(accelerator, optimizer)
        self.stopping = False  # a stop was requested on some rank, as of the last settled step
        self.bad_steps = 0  # consecutive steps skipped for non-finite gradients
        self.applied = True  # whether the last settled step's update was applied
        self.overflowed = False  # whether it was skipped as an fp16 loss-scale overflow (not a bad step)
        self._pending: Tensor | None = None  # the last step's unread verdict: (non-finite, stop, bad loss) summed
        self._pinned: Tensor | None = None  # on CUDA, the host copy of _pending's verdict
        self._copied: torch.cuda.Event | None = None  # recorded after that copy

        # Out of memory in forward/backward: the step is redone with each micro-batch in twice as many slices.
        # One process only: other ranks would wait in a collective for the one that failed. Not FSDP: with gradient
        # sync off (accumulate() before the last micro-batch) FSDP2 keeps the gradients on its unsharded parameters,
        # where zero_grad does not reach, and the retry would add them twice.
        self.pieces = 1
        self.may_halve = accelerator.num_processes == 1 and accelerator.distributed_type not in (
            DistributedType.DEEPSPEED,
            DistributedType.FSDP,
        )

    def train_step(self, batches: Batches) -> StepOutput:
        accelerator, model, device = self.accelerator, self.model, self.accelerator.device
        kept: list[tuple[Tensor, Tensor]] = []  # the step's micro-batches as loaded, replayed after out of memory
        while (loss_sum := self._forward_backward(batches, kept)) is None:
            rows = len(kept[0][0])
            failed, self.pieces = -(-rows // self.pieces), min(2 * self.pieces, rows)  # never an empty slice
            accelerator.print(
                f"step {self.progress.step + 1}: out of memory at micro-batch {failed}; retrying at "
                f"{-(-rows // self.pieces)} × {self.grad_accum * self.pieces} accumulation (the same "
                f"{self.tokens_per_step:,} tokens in the same order)"
            )
        self.settle()  # the previous step's verdict, read while this step's backward runs
        grad_norm = clip_grad_norm(accelerator, model, self.grad_clip)
        status = torch.zeros(3, device=device)
        status[0] = ~torch.isfinite(grad_norm)
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            status[0] = self._deepspeed_skipped(status[0])
        status[1].fill_(float(self.stop()))  # a fill, not a host-to-device copy: no sync
        status[2] = ~torch.isfinite(loss_sum)  # tells an fp16 loss-scale overflow from a diverged step
        status = accelerator.reduce(status, "sum")
        self.progress.tokens_seen += self.tokens_per_step
        self._stage(status)
        # No per-step host sync: fused AdamW skips a non-finite update on the device (found_inf), so the host reads
        # the verdict a step late (settle) and still counts, schedules and reports exactly as if it had waited.
        if self.masks:
            inner = getattr(self.optimizer, "optimizer", self.optimizer)
            inner.found_inf = (status[0] > 0).float()  # fused AdamW leaves weights and state alone where 1
            self.optimizer.step()
            del inner.found_inf
        else:
            applied = self._read_verdict()
            # The GradScaler skips a non-finite update itself, and must see every step: its update() lowers the scale
            # and ends the step's unscale_ (clip_grad_norm), which may not come twice before it.
            if applied or accelerator.scaler is not None:
                self.optimizer.step()
            self._record()
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutput(loss_sum / self.grad_accum, grad_norm)

    def _deepspeed_skipped(self, nonfinite: Tensor) -> float:
        """Whether DeepSpeed skipped the update it made inside accelerator.backward, by its own account: ZeRO skips
        one whose gradient norm is not finite (deepspeed 0.19.8: fp32, and bf16 unless its check_grad_overflow is
        off). One it applied with non-finite gradients cannot be undone: stop at once, saying so."""
        applied = self.model.was_step_applied()
        if applied and nonfinite.item():
            raise self._aborted(
                f"DeepSpeed applied step {self.progress.step + 1}'s update with non-finite gradients (is bf16 "
                "check_grad_overflow off in its config?)"
            )
        return float(not applied)

    def _forward_backward(self, batches: Batches, kept: list[tuple[Tensor, Tensor]]) -> Tensor | None:
        """Forward and backward over the step's grad_accum micro-batches, each cut into `pieces` row slices whose
        losses are weighted by their share of rows (the gradient of the whole micro-batch's mean loss); the sum of
        the micro-batches' mean losses. None when out of memory with a smaller slice left to try: the gradients
        are then cleared and `kept` holds the micro-batches loaded so far, to replay the step from its start."""
        accelerator, model, device = self.accelerator, self.model, self.accelerator.device
        micro_steps = accelerator.step  # accumulate() counts micro-steps to find the last one (the sync)
        loss_sum = torch.zeros((), device=device)
        try:
            for i in range(self.grad_accum):  # accumulate() skips the DDP all-reduce until the last micro-batch
                if i == len(kept):
                    kept.append(next(batches))
                x, y = (t.to(device, non_blocking=True) for t in kept[i])
                with accelerator.accumulate(model):
                    for xs, ys in zip(x.tensor_split(self.pieces), y.tensor_split(self.pieces)):
                        _, loss = model(xs, ys)
                        loss = loss * (len(xs) / len(x)) if self.pieces > 1 else loss
                        accelerator.backward(loss)
                        loss_sum += loss.detach()
            return loss_sum
        except RuntimeError as err:
            if not (self.may_halve and is_out_of_memory(err) and kept and self.pieces < len(kept[0][0])):
                raise
        # The model's own: accelerate's optimizer wrapper clears gradients only at a sync (the last micro-batch), so
        # the earlier micro-batches' would be added again by the retry.
        model.zero_grad(set_to_none=True)
        accelerator.step = micro_steps
        return None

    @property
    def settled(self) -> bool:
        """Whether the last step's verdict has been read: until then progress.step does not count that step."""
        return self._pending is None

    def settle(self) -> bool:
        """Read the last step's verdict now if it is still pending; whether that step was applied."""
        if self._pending is not None:
            self._read_verdict()
            self._record()
        return self.applied

    def _stage(self, status: Tensor) -> None:
        """Queue the verdict for the host. On CUDA a non-blocking copy into pinned memory and an event after it: the
        read then waits for this step only, where .tolist() would also wait for the next step's backward, queued on
        the same stream by then. The buffer is reused: the last verdict is always read before the next is staged."""
        if status.device.type == "cuda":
            if self._pinned is None:
                self._pinned = torch.empty(status.shape, dtype=status.dtype, pin_memory=True)
                self._copied = torch.cuda.Event()
            self._pinned.copy_(status, non_blocking=True)
            self._copied.record()
            status = self._pinned
        self._pending = status

    def _read_verdict(self) -> bool:
        if self._copied is not None:
            self._copied.synchronize()  # the host sync: up to that step's verdict, not past it
        nonfinite, stopping, nonfinite_loss = (v > 0 for v in self._pending.tolist())
        self._pending = None
        self.stopping = self.stopping or stopping
        self.applied = not nonfinite
        scaler = self.accelerator.scaler  # the scale read before the step's update() lowers it
        self.overflowed = nonfinite and scaler is not None and not nonfinite_loss and scaler.get_scale() > 1
        if not self.overflowed:  # an overflow neither ends nor extends a run of bad steps
            self.bad_steps = self.bad_steps + 1 if nonfinite else 0
        return self.applied

    def _record(self) -> None:
        """Count an applied step (the schedule advances per applied update), or report a skipped one."""
        if self.applied:
            self.progress.step += 1
            self.progress.tokens_applied += self.tokens_per_step
            if self.scheduler is not None:
                self.scheduler.step()
            return
        if self.overflowed:
            self.accelerator.print(
                f"step {self.progress.step + 1}: fp16 gradients overflowed, update skipped; loss scale lowered to "
                f"{self.accelerator.scaler.get_scale():g}"
            )
            return
        self.accelerator.print(
            f"step {self.progress.step + 1}: non-finite loss/gradients, update skipped ({self.bad_steps} in a row)"
        )
        if self.bad_steps >= self.max_bad_steps:
            raise self._aborted(
                f"non-finite loss/gradients in {self.max_bad_steps} consecutive steps after step {self.progress.step}"
            )

    def _aborted(self, why: str) -> TrainingAborted:
        """The error that stops the run for `why`, naming the newest checkpoint in run_dir, else the one this launch
        continued from (another run's, with --resume PATH --out-dir NEW)."""
        checkpoints = list_checkpoints(self.run_dir) if self.run_dir else []
        return TrainingAborted(why, checkpoints[-1] if checkpoints else self.resumed_from)
