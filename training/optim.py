"""Optimizer and learning-rate schedule: AdamW with decay/no-decay groups, or Muon for the blocks' matrices with
AdamW for the rest (one optimizer object holding both); linear warmup, then cosine or warmup-stable-decay."""

from __future__ import annotations

import math
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from training.config import TrainConfig


def lr_multiplier(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Fraction of each group's peak lr at optimizer step ``step`` (0-based) of a run of ``total_steps``, by cfg's
    schedule (warmup_steps, lr_schedule, decay_fraction, decay_steps, min_lr_ratio): linear warmup, then
    cosine: a half cosine from 1 to min_lr_ratio at total_steps;
    wsd (warmup-stable-decay): 1 until the last ``decay_fraction`` of all steps, then a straight line to
    min_lr_ratio at total_steps (where a short run's decay would start inside the warmup, the lower of the two);
    ``decay_steps``, where set, is the decay's length in steps instead. Past total_steps (the next step of a finished
    run, which a resume with more steps trains): min_lr_ratio, where the lr ended its decay; a wsd run with no decay
    (the stable part of a run, annealed in a resumed one) stays at its peak."""
    warmup_steps, min_lr_ratio = cfg.warmup_steps, cfg.min_lr_ratio
    warmup = (step + 1) / warmup_steps if step < warmup_steps else 1.0
    decay_steps = cfg.decay_steps or cfg.decay_fraction * total_steps
    if cfg.lr_schedule == "wsd" and not decay_steps:
        return warmup
    if step >= total_steps:
        return min_lr_ratio
    if cfg.lr_schedule == "wsd":
        to_go = total_steps - step  # in [1, total_steps]
        decay = 1.0 if to_go >= decay_steps else min_lr_ratio + (1.0 - min_lr_ratio) * to_go / decay_steps
        return min(warmup, decay)
    if step < warmup_steps:
        return warmup
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr_ratio + 0.5 * (1.0 - min_lr_ratio) * (1.0 + math.cos(math.pi * progress))


def highest_multiplier(cfg: TrainConfig, total_steps: int) -> float:
    """The highest fraction of the peak lr a run of total_steps trains at: 1, but where its warmup is as long as the
    run (lower still where a short wsd run's decay cuts into its warmup). Past the warmup the lr only falls."""
    return max(lr_multiplier(step, cfg, total_steps) for step in range(min(total_steps, cfg.warmup_steps + 1)))


def decay_start(cfg: TrainConfig, total_steps: int) -> int | None:
    """wsd: how many optimizer steps a run of total_steps takes before its decay lowers the lr. Any longer run of the
    same schedule gives those steps the same lrs, so the checkpoint after them is where a longer run branches off
    (from a later one it would go back up to the peak lr). None for cosine, whose lrs depend on the total from the
    warmup on, and where no step is before the decay or none decays."""
    if cfg.lr_schedule != "wsd":
        return None
    decay_steps = cfg.decay_steps or cfg.decay_fraction * total_steps
    start = max(0, math.floor(total_steps - decay_steps))
    while start > 0 and total_steps - (start - 1) < decay_steps:  # lr_multiplier's test, float for float
        start -= 1
    # the first step whose lr the decay lowers below the warmup's (a short run's decay may start inside the warmup)
    while start < total_steps:
        if lr_multiplier(start, cfg, total_steps) != min(1.0, (start + 1) / max(1, cfg.warmup_steps)):
            break
        start += 1
    return start if 0 < start < total_steps else None


def newton_schulz_dtype(mixed_precision: str) -> torch.dtype:
    """Muon's Newton-Schulz matmuls in bf16 where the run's matmuls are (its launch YAML says bf16: GPUs, AMX and
    Zen 4/5 CPUs, where bf16 is the fast dtype), else in fp32: on the CPUs that train in fp32 (AVX2-only, Xeons
    without AMX) and on fp16 GPUs, bf16 matmuls are emulated or slower (BENCHMARKS.md, "Muon's Newton-Schulz")."""
    return torch.bfloat16 if mixed_precision == "bf16" else torch.float32


# The most elements one Newton-Schulz batch stacks: GPT-2 124M's same-shaped matrices go in one batch each, and at
# 1558M a batch holds 6 of its 1,600 x 6,400 matrices, so what a step allocates besides its state stays under
# ~1 GiB at any size (a batch's fp32 updates and their stack, 256 MiB each, then the bf16 iteration's).
MAX_BATCH_ELEMENTS = 1 << 26


class Muon(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz iterations in ``ns_dtype``, run on each group's same-shaped matrices
    as one batch (a GPU then launches a few batched matmuls a step instead of hundreds of small ones). torch's own
    casts the update to bf16 and iterates matrix by matrix; with ns_dtype=torch.bfloat16 this step is torch's, bit
    for bit, on the CPU (tests/training/test_optim.py). Its arguments, groups and state (momentum_buffer) are
    torch's, with Keller Jordan's lr scaling ("original": sqrt(max(1, rows / cols)), the one whose lr 0.02
    modded-nanogpt tuned)."""

    def __init__(self, params: Any, *, ns_dtype: torch.dtype, **kwargs: Any) -> None:
        super().__init__(params, adjust_lr_fn="original", **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        if closure is not None:
            raise ValueError("Muon.step takes no closure")
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            buffers: list[torch.Tensor] = []
            self._init_group(group, params, grads, buffers)
            if not params:
                continue
            lr, momentum = group["lr"], group["momentum"]
            torch._foreach_lerp_(buffers, grads, 1 - momentum)
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            ns = group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype
            for batch in same_shape_batches(params):
                grad, buffer = [grads[i] for i in batch], [buffers[i] for i in batch]
                orthogonal = newton_schulz(
                    torch._foreach_lerp(grad, buffer, momentum) if group["nesterov"] else buffer, *ns
                )
                rows, cols = params[batch[0]].shape
                torch._foreach_add_(
                    [params[i] for i in batch], list(orthogonal), alpha=-lr * math.sqrt(max(1, rows / cols))
                )


def same_shape_batches(params: list[torch.Tensor]) -> list[list[int]]:
    """The indices of params in batches of one shape, dtype and device, each of at most MAX_BATCH_ELEMENTS."""
    by_kind: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        by_kind.setdefault((p.shape, p.dtype, p.device), []).append(i)
    batches = []
    for (shape, _, _), index in by_kind.items():
        size = max(1, MAX_BATCH_ELEMENTS // shape.numel())
        batches += [index[start : start + size] for start in range(0, len(index), size)]
    return batches


def newton_schulz(
    updates: list[torch.Tensor], coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """Keller Jordan's quintic Newton-Schulz iteration towards the nearest semi-orthogonal matrix, in dtype, as
    torch.optim.Muon runs it in bf16 (the wide orientation, each matrix's Frobenius norm scaled to at most 1), on
    same-shaped matrices stacked into one batch: (len(updates), rows, cols), each matrix's result equal bit for
    bit to its own iteration's on the CPU at one thread (with more, the batched fp32 baddbmm sums in another order:
    within fp32 rounding). The stack is a copy: the caller's tensors are left as they were."""
    a, b, c = coefficients
    x = torch.stack(updates).to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x.div_(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


class AdamWWithMuon(torch.optim.Optimizer):
    """AdamW and Muon as one optimizer, for what takes exactly one (the Trainer, accelerate's prepare,
    save_state and load_state, one LambdaLR): step() steps both, state_dict() holds both, and param_groups and
    state are both optimizers' own, read live (load_state_dict replaces them), so the schedule scales each group
    from its own initial lr. Muon has no fused found_inf, so neither has this (no _step_supports_amp_scaling):
    the Trainer reads each step's finiteness verdict before stepping."""

    def __init__(self, adamw: torch.optim.AdamW, muon: Muon) -> None:
        self.adamw, self.muon = adamw, muon
        super().__init__([{"params": []}], {})  # an Optimizer's hooks; its groups and state are the two below

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.adamw.param_groups + self.muon.param_groups  # as GPT.optimizer_groups orders them

    @param_groups.setter
    def param_groups(self, _: list) -> None:  # Optimizer.__init__'s own (empty) list: not used
        pass

    @property
    def state(self) -> dict[torch.Tensor, Any]:
        return {**self.adamw.state, **self.muon.state}  # disjoint parameters

    @state.setter
    def state(self, _: dict) -> None:  # Optimizer.__init__'s own (empty) state: not used
        pass

    def step(self, closure: None = None) -> None:
        if closure is not None:
            raise ValueError("AdamWWithMuon.step takes no closure")
        self.adamw.step()
        self.muon.step()

    def state_dict(self) -> dict[str, Any]:
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.adamw.load_state_dict(state_dict["adamw"])
        self.muon.load_state_dict(state_dict["muon"])


def build_optimizer(
    param_groups: list[dict],
    *,
    lr: float,
    betas: tuple[float, float],
    device_type: str,
    muon_lr: float = 0.02,
    muon_momentum: float = 0.95,
    mixed_precision: str = "no",
) -> torch.optim.Optimizer:
    """AdamW over the groups, fused where torch has a fused kernel for the device (CUDA, and CPU since torch 2.4),
    else foreach. A group named "muon" (GPT.optimizer_groups(muon=True)) goes to Muon instead (torch's, Nesterov
    momentum, Keller Jordan's lr scaling), its Newton-Schulz in the dtype newton_schulz_dtype picks for the run's
    mixed precision; the rest to AdamW."""
    fused = device_type in ("cuda", "cpu")
    adamw_groups = [g for g in param_groups if g.get("name") != "muon"]
    adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, eps=1e-8, fused=fused, foreach=None if fused else True)
    muon_groups = [g for g in param_groups if g.get("name") == "muon"]
    if not muon_groups:
        return adamw
    muon = Muon(
        muon_groups, lr=muon_lr, momentum=muon_momentum, nesterov=True, ns_dtype=newton_schulz_dtype(mixed_precision)
    )
    return AdamWWithMuon(adamw, muon)


def optimizer_for(
    cfg: TrainConfig, param_groups: list[dict], device_type: str, mixed_precision: str = "no"
) -> torch.optim.Optimizer:
    """build_optimizer with the run config's settings: training and the speed ladder build the same optimizer."""
    return build_optimizer(
        param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), device_type=device_type, muon_lr=cfg.muon_lr,
        muon_momentum=cfg.muon_momentum, mixed_precision=mixed_precision,
    )  # fmt: skip


STEP_SET = ("params", "lr", "momentum")  # a group's keys that are not hyperparameters of the launch
MUON_MOMENTUM_START = 0.85  # modded-nanogpt's Muon momentum warmup: 0.85 to 0.95 over its first 300 steps


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR (each group's lr = its initial lr × the multiplier), which also warms up the momentum of the groups
    that have one (Muon's) linearly from MUON_MOMENTUM_START to its initial value over the first ``momentum_warmup``
    steps (an initial value below that start is held throughout). The momenta follow from the step alone, so a
    resumed run sets the same ones at the same step."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_lambda: Any, *, momentum_warmup: int = 0) -> None:
        self.momentum_warmup = momentum_warmup  # before LambdaLR's first step() reads it
        for group in optimizer.param_groups:
            if "momentum" in group:
                group.setdefault("initial_momentum", group["momentum"])  # kept in the optimizer's state_dict
        super().__init__(optimizer, lr_lambda)

    def span(self, total_steps: int) -> None:
        """Make the schedule end at total_steps from now on, and set the current step's lrs by it (a time budget's
        decision, taken where the lrs so far do not depend on the total: the warmup)."""
        self.lr_lambdas = [partial(fn, total_steps=total_steps) for fn in self.lr_lambdas]
        self._set_lrs()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The saved step and lrs; the momentum warmup stays this launch's (a resume may change
        --muon-momentum-warmup-steps, and its line says the run goes on with the new one)."""
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "momentum_warmup"})

    def configured(self) -> list[dict[str, Any]]:
        """Each group's hyperparameters as this launch built them (lr and momentum aside: the step sets those)."""
        return [{k: v for k, v in g.items() if k not in STEP_SET} for g in self.optimizer.param_groups]

    def keep_configured(self, configured: list[dict[str, Any]]) -> None:
        """After a resume's load, which brings the saved launch's hyperparameters (initial lr, weight decay, betas,
        Muon's momentum): this launch's again (`configured`, read before the load), so a resume with a changed
        --lr or --weight-decay trains with it, as it says; the current step's lrs and momenta set by them."""
        for group, mine in zip(self.optimizer.param_groups, configured, strict=True):
            group.update(mine)
        self.base_lrs = [group["initial_lr"] for group in self.optimizer.param_groups]
        self._set_lrs()
        self._set_momenta()

    def _set_lrs(self) -> None:
        lrs = [base * fn(self.last_epoch) for base, fn in zip(self.base_lrs, self.lr_lambdas, strict=True)]
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = lrs

    def next_multiplier(self) -> float:
        """The next step's lr as a fraction of its peak (every group has the same): after a resume's load and before
        keep_configured, the saved schedule's."""
        return self.get_last_lr()[0] / self.base_lrs[0]

    def lrs_of_step(self, step: int) -> list[float]:
        """Each group's lr in optimizer step `step` (counted from 1, as logged); get_last_lr() is the next step's."""
        return [base * fn(step - 1) for base, fn in zip(self.base_lrs, self.lr_lambdas, strict=True)]

    def keeps_past(self, total_steps: int) -> bool:
        """Whether a schedule ending at total_steps would have given every step taken so far the lrs it had, so
        that span(total_steps) now trains exactly as a run built for total_steps. lr_multiplier depends on the
        total only from some step on (cosine: the end of the warmup; wsd: the start of its decay), so the last
        step taken decides."""
        last = self.last_epoch - 1
        return all(fn(last, total_steps=total_steps) == fn(last) for fn in self.lr_lambdas)

    def nearest_span(self, wanted: int, current: int) -> int:
        """The total nearest `wanted`, between it and `current`, that keeps_past (current when none does)."""
        direction = 1 if wanted <= current else -1
        return next((total for total in range(wanted, current, direction) if self.keeps_past(total)), current)

    def step(self) -> None:
        super().step()
        self._set_momenta()

    def _set_momenta(self) -> None:
        frac = min(1.0, self.last_epoch / self.momentum_warmup) if self.momentum_warmup else 1.0
        for group in self.optimizer.param_groups:
            if "momentum" in group:
                start = min(MUON_MOMENTUM_START, group["initial_momentum"])
                group["momentum"] = start + frac * (group["initial_momentum"] - start)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> Schedule:
    """cfg's schedule over cfg.total_steps() for every group: its lr is its own initial lr times lr_multiplier
    (Muon's and AdamW's alike), and Muon's momentum warms up over cfg.muon_momentum_warmup_steps (0: none)."""
    multiplier = partial(lr_multiplier, cfg=cfg, total_steps=cfg.total_steps())
    return Schedule(optimizer, multiplier, momentum_warmup=cfg.muon_momentum_warmup_steps)
