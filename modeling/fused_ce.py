"""Linear + cross-entropy without the full logits tensor (the "fused linear cross-entropy" of Liger-Kernel).

The plain path, F.cross_entropy(h @ W.T, targets), writes a (tokens, vocab) logits tensor and reads it back
several times in forward and backward; at 2,048 tokens x 50,304 ids that is ~400 MB in fp32 per pass and
about a third of a small model's step on CPU. Here the rows are processed in chunks: for each chunk the
forward pass computes the logits, the log-sum-exp, the loss AND the gradients w.r.t. h and W right away,
so the chunk's logits are dropped before the next one. Backward only scales the stored gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Rows of h per chunk. Measured fwd+bwd, bf16 autocast, torch.compile, 2,048 rows x 50,304 ids on a 2-core
# AVX-512 Xeon: with n_embd 16 (so the softmax, not the matmuls, dominates) 256 rows take 148 ms, 512 163,
# 1024 200, 2048 394, plain F.cross_entropy 281 (128 rows was 15% slower than 256 in another run). At n_embd
# 256: 1189 vs 1330 ms plain, both mostly the three bf16 matmuls on that CPU.
CHUNK_ROWS = 256
MAX_CHUNKS = 8


@torch.library.custom_op("bookgpt::addmm_", mutates_args=("out",))
def addmm_(out: Tensor, a: Tensor, b: Tensor) -> None:
    """out += a @ b in place. An op of its own because torch.compile would otherwise give every chunk's fp32 sum
    a fresh (V, E) buffer and copy the previous sum into it first (a 50,304 x 256 copy per chunk, ~3% of a
    small-cpu step)."""
    out.addmm_(a, b)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        h: Tensor,
        weight: Tensor,
        targets: Tensor,
        ignore_index: int,
        compute_dtype: torch.dtype,
        chunk_rows: int,
        need_grad_h: bool,
        need_grad_w: bool,
    ) -> Tensor:
        # The matmuls run in compute_dtype (bf16 under autocast); softmax, log-sum-exp and the grad_w sum in
        # at least fp32.
        acc_dtype = torch.promote_types(compute_dtype, torch.float32)
        h_c, w_c = h.to(compute_dtype), weight.to(compute_dtype)
        valid = targets != ignore_index
        n_valid = valid.sum()
        # Ignored rows get zero gradient; clamp so that all-ignored gives zero grads (loss is nan, as in
        # F.cross_entropy with reduction="mean").
        row_scale = (valid / n_valid.clamp(min=1)).to(acc_dtype)  # (N,) d(mean loss)/d(row loss)
        safe_targets = torch.where(valid, targets, 0)

        grad_h = torch.empty_like(h) if need_grad_h else None
        grad_w = torch.zeros_like(weight, dtype=acc_dtype) if need_grad_w else None
        loss_sum = torch.zeros((), dtype=acc_dtype, device=h.device)
        # Under bf16 autocast torch.compile (inductor) sums the chunks' (V, E) grad_w products in one kernel after
        # the last chunk, so all of them are alive at once: cap their number (a bigger batch gets bigger chunks).
        chunk_rows = max(chunk_rows, -(-h.shape[0] // MAX_CHUNKS))
        for start in range(0, h.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            logits = (h_c[rows] @ w_c.t()).to(acc_dtype)  # (chunk, V)
            target_logits = logits.gather(1, safe_targets[rows, None])  # (chunk, 1)
            # log-sum-exp by hand so exp() runs once per logit and is reused for the softmax; in place
            # over the logits (eager CPU pays a page fault per touched page of every new big tensor).
            row_max = logits.amax(dim=-1, keepdim=True)
            exp = logits.sub_(row_max).exp_()
            sum_exp = exp.sum(dim=-1, keepdim=True)
            row_loss = (row_max + sum_exp.log() - target_logits).squeeze(1)  # lse - target logit
            loss_sum += (row_loss * valid[rows]).sum()
            if not (need_grad_h or need_grad_w):
                continue
            # d loss / d logits = (softmax - onehot) * row_scale; the softmax part here, one fused pointwise
            # kernel under torch.compile (a scatter into it would cost a copy of the chunk).
            grad_logits = exp.mul_(row_scale[rows, None] / sum_exp).to(compute_dtype)
            if need_grad_h:
                grad_h[rows] = grad_logits @ w_c
            if need_grad_w:
                if compute_dtype == acc_dtype:
                    addmm_(grad_w, grad_logits.t(), h_c[rows])
                else:  # bf16 products: inductor sums them into the fp32 grad_w in one kernel after the loop
                    grad_w += grad_logits.t() @ h_c[rows]
        # The -onehot * row_scale part, applied to the products directly: row r of grad_h loses
        # row_scale[r] * W[t_r], and row t_r of grad_w loses row_scale[r] * h[r].
        if need_grad_h:
            grad_h -= row_scale[:, None] * w_c[safe_targets]
        if need_grad_w:
            grad_w.index_add_(0, safe_targets, -row_scale[:, None] * h_c)
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        return loss_sum / n_valid

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        grad_h = None if grad_h is None else grad_h * grad_output
        grad_w = None if grad_w is None else grad_w * grad_output
        return grad_h, grad_w, None, None, None, None, None, None


def fused_linear_cross_entropy(
    h: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100, chunk_rows: int = CHUNK_ROWS
) -> Tensor:
    """Mean cross-entropy of logits h @ weight.T, equal to F.cross_entropy(h @ weight.T, targets) in value
    and gradients. h: (N, E) hidden states, weight: (V, E) head, targets: (N,) ids or ignore_index.
    Under no_grad (evaluation) only the loss is computed, a third of the matmul work."""
    device_type = h.device.type
    autocast = torch.is_autocast_enabled(device_type)
    compute_dtype = torch.get_autocast_dtype(device_type) if autocast else h.dtype
    grad_enabled = torch.is_grad_enabled()
    return _FusedLinearCrossEntropy.apply(
        h,
        weight,
        targets,
        ignore_index,
        compute_dtype,
        chunk_rows,
        grad_enabled and h.requires_grad,
        grad_enabled and weight.requires_grad,
    )
