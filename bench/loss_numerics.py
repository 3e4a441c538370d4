"""Accuracy of the training loss against an fp64 reference, from uniform to confident predictions.

    python -m bench.loss_numerics [--device cuda]

For each precision a launch YAML can select (fp32, bf16 and fp16 autocast) and each confidence level, prints the
relative error of the loss and of its gradients w.r.t. the hidden states (grad_h) and the head (grad_w), for
F.cross_entropy over the full logits and for modeling.fused_ce, eager and compiled. Confident predictions are what
long training on a small corpus reaches (memorized text): there the softmax and the one-hot target nearly cancel.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.measure import check_can_compile, device_arg
from data_prep import number_arg
from modeling.fused_ce import fused_linear_cross_entropy
from training.compile_cache import set_up_compile_cache

IGNORE_EVERY = 9  # every 9th row is ignore_index, as padded or masked positions are
FP16_LOSS_SCALE = 2.0**16  # torch.amp.GradScaler's initial scale
LossFn = Callable[[Tensor, Tensor, Tensor], Tensor]


def _mean_p_target(h: Tensor, weight: Tensor, targets: Tensor) -> float:
    valid = targets != -100
    logp = torch.log_softmax(h[valid] @ weight.t(), dim=-1)
    return logp.gather(1, targets[valid, None]).exp().mean().item()


def confident_inputs(
    p_target: float, n: int = 256, n_embd: int = 64, vocab: int = 2048, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """fp64 (h, weight, targets) whose mean softmax probability of the target is p_target (to ~1e-3 relative in
    1 - p_target): the hidden states are pushed toward their target's head row, as training does."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, n_embd, generator=g, dtype=torch.float64) / n_embd**0.5
    targets = torch.randint(0, vocab, (n,), generator=g)
    noise = torch.randn(n, n_embd, generator=g, dtype=torch.float64) / n_embd**0.5
    direction = weight[targets]
    lo, hi = 0.0, 1e4  # bisect the push on log(1 - p), which moves smoothly from uniform to ~1 - 1e-12
    for _ in range(60):
        push = (lo + hi) / 2
        p = _mean_p_target(noise + push * direction, weight, targets)
        lo, hi = (push, hi) if p < p_target else (lo, push)
    targets = targets.clone()
    targets[::IGNORE_EVERY] = -100
    return noise + push * direction, weight, targets


def plain_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(h @ weight.t(), targets)


def loss_and_grads(loss_fn: LossFn, h: Tensor, weight: Tensor, targets: Tensor, precision: str) -> list[Tensor]:
    """Loss, grad_h, grad_w in fp64 of loss_fn on fp32 copies of h and weight (the fp32 master weights), under
    autocast to precision ('fp32', 'bf16' or 'fp16'). fp16 backpropagates a loss scaled by 2**16 and unscales
    the gradients, as accelerate's GradScaler does."""
    h, weight = h.float().requires_grad_(), weight.float().requires_grad_()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    with torch.autocast(h.device.type, dtype=dtype) if dtype else contextlib.nullcontext():
        loss = loss_fn(h, weight, targets)
    scale = FP16_LOSS_SCALE if precision == "fp16" else 1.0
    (loss * scale).backward()
    return [loss.detach().double(), h.grad.double() / scale, weight.grad.double() / scale]


def reference(h: Tensor, weight: Tensor, targets: Tensor) -> list[Tensor]:
    """Loss, grad_h, grad_w of F.cross_entropy in fp64: the ground truth."""
    h, weight = h.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = plain_cross_entropy(h, weight, targets)
    loss.backward()
    return [loss.detach(), h.grad, weight.grad]


def relative_errors(got: list[Tensor], want: list[Tensor]) -> list[float]:
    """|got - want| / |want| for the loss, grad_h and grad_w (Frobenius norms)."""
    return [((g.cpu() - w).norm() / w.norm()).item() for g, w in zip(got, want, strict=True)]


# --p-target: a mean probability strictly between 0 and 1 (at 1 or above the bisection's inputs give a table of nan
# errors, below 0 one of uniform predictions under the asked-for label)
probability = number_arg("a number", lambda v: 0 < v < 1, "between 0 and 1 (exclusive)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.loss_numerics", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--p-target", type=probability, nargs="+", default=[0.5, 0.94, 0.99995, 1 - 1e-8])
    # loss_and_grads autocasts to bf16 and fp16 only: any other name would time fp32 under its own label
    parser.add_argument("--precisions", nargs="+", choices=("fp32", "bf16", "fp16"), default=["fp32", "bf16", "fp16"])
    parser.add_argument(
        "--device", type=device_arg, default="cpu", choices=("cpu", "cuda"), help="where the losses run (fp64: CPU)"
    )
    args = parser.parse_args(argv)
    check_can_compile(torch.device(args.device), "inductor")
    set_up_compile_cache(torch.device(args.device))
    fns = {
        "F.cross_entropy": plain_cross_entropy,
        "fused": fused_linear_cross_entropy,
        "fused, compiled": torch.compile(fused_linear_cross_entropy),  # the form every launch YAML runs
    }
    print("| precision | mean p(target) | " + " | ".join(f"{k}: loss / grad_h / grad_w" for k in fns) + " |")
    print("|---|---|" + "---|" * len(fns))
    for p in args.p_target:
        h, weight, targets = confident_inputs(p)
        want = reference(h, weight, targets)
        for precision in args.precisions:
            cells = []
            for fn in fns.values():
                inputs = (t.to(args.device) for t in (h, weight, targets))
                errs = relative_errors(loss_and_grads(fn, *inputs, precision), want)
                cells.append(" / ".join(f"{e:.2g}" for e in errs))
            print(f"| {precision} | {_mean_p_target(h, weight, targets):.8g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
