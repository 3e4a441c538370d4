"""Linear + cross-entropy without the full logits tensor (the "fused linear cross-entropy" of Liger-Kernel).

The plain path, F.cross_entropy(h @ W.T, targets), writes a (tokens, vocab) logits tensor and reads it back
several times in forward and backward; at 2,048 tokens x 50,304 ids that is ~400 MB in fp32 per pass and
about a third of a small model's step on CPU. Here the rows are processed in chunks: for each chunk the
forward pass computes the logits, the log-sum-exp, the loss AND the gradients w.r.t. h and W right away,
so the chunk's logits are dropped before the next one. Backward only scales the stored gradients. In bf16 on the
CPU a chunk's logits are one product per 4,096 ids of the head (logits_by_slabs), which AMX runs faster; on the CPU
the chunk's softmax, loss and logit gradient are one C kernel (modeling/cpu_softmax.py) wherever gcc can build it,
and softmax_grad's torch ops elsewhere.

Which of the two forms the model's loss takes is one rule, takes_full_logits: the full logits on CUDA under
torch.compile while they fit (inductor's code for this form is 5% slower there), this form elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from modeling import cpu_linear, cpu_softmax
from modeling.fp8_head import fp8_logits

# Rows of h per chunk, and a cap on the number of chunks (BENCHMARKS.md, "fused loss" and "Chunk size on a Zen 5", has
# the timings: on the CPU a chunk's bf16 grad_w product costs a pass over 25 MB more in the sum, so fewer chunks win).
CHUNK_ROWS = 1024
MAX_CHUNKS = 8
# Columns of the logits per product in bf16 on the CPU (logits_by_slabs; BENCHMARKS.md, "The head's forward by
# vocabulary slabs"): 2,048-8,192 timed alike on an AMX Xeon.
VOCAB_SLAB = 4096


@torch.library.custom_op("bookgpt::logits_by_slabs", mutates_args=())
def logits_by_slabs(x: Tensor, weight: Tensor, slab: int) -> Tensor:
    """x @ weight.T for x (N, E) and weight (V, E), one product per `slab` rows of weight, each written into its
    columns of the (N, V) result. On an AMX Xeon oneDNN's bf16 kernel runs the whole (N, E) x (E, 50,304) product at
    ~0.4 TFLOP/s and (E, 4,096) slabs of it at ~0.7: the loss's forward + backward at n_embd 128-256 takes 12-20%
    less; without AMX the two time alike. Every entry is the same dot product over E: F.linear's, bit for bit on the
    AMX Xeon measured, and within one bf16 step wherever a kernel sums in another order.
    An op of its own, so that torch.compile keeps the slabs (it would merge nothing into an extern matmul anyway)."""
    out = x.new_empty((x.shape[0], weight.shape[0]))
    for start in range(0, weight.shape[0], slab):
        torch.mm(x, weight[start : start + slab].t(), out=out[:, start : start + slab])
    return out


@logits_by_slabs.register_fake
def _(x: Tensor, weight: Tensor, slab: int) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("bookgpt::addmm_", mutates_args=("out",))
def addmm_(out: Tensor, a: Tensor, b: Tensor, onednn: bool) -> None:
    """out += a @ b in place. An op of its own because torch.compile would otherwise give every chunk's fp32 sum
    a fresh (V, E) buffer and copy the previous sum into it first. onednn: the product by oneDNN's fp32 kernels, then
    the sum (~0.7x MKL's in-place addmm on a Zen 5; modeling/cpu_linear.py)."""
    if onednn:
        out.add_(cpu_linear.weight_grad(a.t(), b))
    else:
        out.addmm_(a, b)


@torch.library.custom_op("bookgpt::put_targets_", mutates_args=("grad",))
def put_targets_(grad: Tensor, target: Tensor, values: Tensor) -> None:
    """grad[i, target[i]] = values[i] in place, for grad (N, V), target and values (N, 1). An op of its own: under
    torch.compile a scatter_ into the (N, V) gradient makes inductor write it out whole a second time. index_put_, as
    aten's bf16 scatter_ takes ~80 ms on a (1,024 x 50,304) chunk (fp32: microseconds; index_put_ either way)."""
    grad.index_put_((torch.arange(grad.shape[0], device=grad.device), target[:, 0]), values[:, 0])


@torch.library.custom_op("bookgpt::accumulate_", mutates_args=("out",))
def accumulate_(out: Tensor, x: Tensor) -> None:
    """out += x in place, for each chunk's loss sum. An op of its own: under torch.compile inductor fuses the chain of
    the chunks' sums into one kernel after the last chunk, which keeps every chunk's logits and logit gradients alive
    until then (CUDA, B16 at gpt2-124m: 3.26 GiB against 0.85 with this op; BENCHMARKS.md, "The loss's form")."""
    out.add_(x)


@torch.library.custom_op("bookgpt::target_logits", mutates_args=())
def target_logits(logits: Tensor, target: Tensor) -> Tensor:
    """logits.gather(1, target). An op of its own: no later kernel reads the chunk's (chunk, V) logits to gather from
    them, so they are freed after the chunk's softmax (CUDA, as above: 0.85 -> 0.60 GiB)."""
    return logits.gather(1, target)


@target_logits.register_fake
def _(logits: Tensor, target: Tensor) -> Tensor:
    return logits.new_empty(target.shape)


def softmax_grad(
    product: Tensor, target: Tensor, row_scale: Tensor, compiled: bool, write_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """Each row's loss, -log softmax(product)[target] as (rows, 1), and with write_grad d(loss)/d(product) =
    (softmax - onehot(target)) * row_scale in product's dtype, for the chunk's product (rows, V) and target,
    row_scale (rows, 1): the loss's torch form (the CPU's kernel is modeling.cpu_softmax). The same arithmetic in two
    forms, each slow in the other mode: inductor writes a scatter_'s (chunk, V) input out whole, eager allocates every
    where() (BENCHMARKS.md, "Loss accuracy")."""
    compute_dtype = product.dtype
    acc_dtype = torch.promote_types(compute_dtype, torch.float32)
    # from the product as the matmul wrote it: an fp32 copy for the op would be a (chunk, V) buffer of its own
    target_logit = target_logits(product, target).to(acc_dtype)  # (chunk, 1)
    logits = product.to(acc_dtype)
    row_max = logits.amax(dim=-1, keepdim=True)
    shifted = logits.sub_(row_max)  # in place (eager CPU pays a page fault per touched page of a new tensor)
    # The other ids' mass, summed without the target's term: 1 - p_target = other / (other + exp_target)
    # stays exact as p_target -> 1, where the full sum minus exp_target would cancel to 0.
    if compiled:  # one pass per row, in cache: the mass below the row's max and at it (a float compare)
        exp = shifted.exp()
        below = shifted < 0
        below_max = torch.where(below, exp, 0.0).sum(dim=-1, keepdim=True)
        at_max = torch.where(below, 0.0, exp).sum(dim=-1, keepdim=True)  # exp(0) per id at the max
        sum_exp = below_max + at_max
        exp_target = (target_logit - row_max).exp()
        # The target alone at the max (every row with p_target > 1/2): the others are the ids below it.
        # Otherwise other >= exp(0) >= exp_target, and the difference loses at most a bit.
        alone = (target_logit == row_max) & (at_max < 1.5)
        other = torch.where(alone, below_max, sum_exp - exp_target)
    else:  # eager: in place, no new (chunk, V) tensor
        exp = shifted.exp_()
        exp_target = exp.gather(1, target)
        other = exp.scatter_(1, target, 0.0).sum(dim=-1, keepdim=True)
        sum_exp = other + exp_target
    # loss = -log p_target: log1p keeps its precision near 0 (confident rows); the lse form when the
    # target's exp underflows.
    row_loss = torch.where(exp_target > 0.5, torch.log1p(other / exp_target), row_max + sum_exp.log() - target_logit)
    if not write_grad:
        return row_loss, None
    # d(mean loss)/d(logits) = (softmax - onehot) * row_scale, whole in fp32 before the cast to
    # compute_dtype; its target entry p_target - 1 = -other / sum_exp.
    inv = row_scale / sum_exp
    if compiled:  # its target entries written after, in place
        grad_logits = (exp * inv).to(compute_dtype)
        put_targets_(grad_logits, target, (-other * inv).to(compute_dtype))
    else:
        grad_logits = exp.mul_(inv).scatter_(1, target, -other * inv).to(compute_dtype)
    return row_loss, grad_logits


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
        # The matmuls run in compute_dtype (bf16 under autocast); the softmax, the loss, d(loss)/d(logits) and
        # the grad_w sum in fp32.
        acc_dtype = torch.promote_types(compute_dtype, torch.float32)
        h_c, w_c = h.to(compute_dtype), weight.to(compute_dtype)
        valid = targets != ignore_index
        n_valid = valid.sum()
        # Ignored rows get zero gradient; clamp so that all-ignored gives zero grads (loss is nan, as in
        # F.cross_entropy with reduction="mean").
        row_scale = (valid / n_valid.clamp(min=1)).to(acc_dtype)[:, None]  # (N, 1) d(mean loss)/d(row loss)
        safe_targets = torch.where(valid, targets, 0)[:, None]  # (N, 1)

        grad_h = torch.empty_like(h) if need_grad_h else None
        grad_w = torch.zeros_like(weight, dtype=acc_dtype) if need_grad_w else None
        loss_sum = torch.zeros((), dtype=acc_dtype, device=h.device)
        # Under bf16 autocast torch.compile (inductor) sums the chunks' (V, E) grad_w products in one kernel after
        # the last chunk, so all of them are alive at once: cap their number (a bigger batch gets bigger chunks).
        chunk_rows = max(chunk_rows, -(-h.shape[0] // MAX_CHUNKS))
        compiled = torch.compiler.is_compiling()
        need_grad = need_grad_h or need_grad_w
        # fp32 products on AVX-512 AMD CPUs through oneDNN in training (modeling/cpu_linear.py); x @ w.t() as a linear
        onednn = need_grad and cpu_linear.takes(h_c, w_c)
        linear = cpu_linear.onednn_linear if onednn else F.linear
        by_slabs = h.device.type == "cpu" and compute_dtype == torch.bfloat16
        for start in range(0, h.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            target = safe_targets[rows]
            # (chunk, V) in compute_dtype
            product = logits_by_slabs(h_c[rows], w_c, VOCAB_SLAB) if by_slabs else linear(h_c[rows], w_c, None)
            if cpu_softmax.takes(product):  # the loss and, over the logits, their gradient: one C kernel
                row_loss = cpu_softmax.softmax_grad_(product, target, row_scale[rows], need_grad)
                grad_logits = product
            else:
                row_loss, grad_logits = softmax_grad(product, target, row_scale[rows], compiled, need_grad)
            accumulate_(loss_sum, (row_loss * valid[rows, None]).sum())
            if not need_grad:
                continue
            if need_grad_h:
                grad_h[rows] = linear(grad_logits, w_c.t(), None)
            if need_grad_w:
                if compute_dtype == acc_dtype:
                    addmm_(grad_w, grad_logits.t(), h_c[rows], onednn)
                else:  # bf16 products: inductor sums them into the fp32 grad_w in one kernel after the loop
                    grad_w += grad_logits.t() @ h_c[rows]
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        return loss_sum / n_valid

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        grad_h, grad_w = ctx.saved_tensors
        grad_h = None if grad_h is None else grad_h * grad_output
        grad_w = None if grad_w is None else grad_w * grad_output
        return grad_h, grad_w, None, None, None, None, None, None


# The largest full logits tensor (tokens x vocab in the compute dtype) the full-logits form may build, as a share of
# the device's memory: 1/8 is 10 GiB on an 80 GB H100, micro-batch 64 at T 1024 of GPT-2's 50,304 ids in bf16 (6.1 GiB).
FULL_LOGITS_MAX_SHARE = 1 / 8


def takes_full_logits(device_type: str, compiling: bool, logits_bytes: int, device_bytes: int | None) -> bool:
    """Whether the training loss is F.cross_entropy on the full logits (True) or the fused form (False): the full
    logits on CUDA under torch.compile while they take at most FULL_LOGITS_MAX_SHARE of the device's memory
    (device_bytes); the fused form on CPUs (and MPS), in eager mode and where the full logits would be too large.

    Measured (BENCHMARKS.md, "GPU"), forward + backward of the loss alone at gpt2-124m, B16 x T1024 (16,384 rows x
    50,304 ids), bf16 autocast:
    - H100, torch 2.11, compiled: F.cross_entropy 7.62 ms / 1.51 GiB, fused 8.70 ms / 3.02 GiB; on an H200, with
      accumulate_ and target_logits, F.cross_entropy 7.55 ms / 1.54 GiB, fused 7.91 ms / 0.60 GiB: under compile
      the full logits are faster while they fit, the fused form smaller past that;
    - H100, eager: fused 21.77 ms / 1.25 GiB, F.cross_entropy 14.05 ms / 7.83 GiB: eager F.cross_entropy keeps fp32
      copies of the logits (6x the fused form's memory), so eager takes the fused form (evals run eager);
    - CPU, 16,384 rows at n_embd 768, bf16, peak RSS over a 0.41 GiB baseline: fused compiled 1.58 GiB, fused eager
      1.87, F.cross_entropy compiled 2.34; 2,048 rows at n_embd 256, compiled: fused 1,189 ms, F.cross_entropy
      1,330 (BENCHMARKS.md, "Loss accuracy"). CPUs take the fused form, compiled or not.
    The whole device's memory, not its free memory, sets the cap: the choice is made while torch.compile traces, and
    it must be the same on every rank and at every recompile."""
    if device_type != "cuda" or not compiling:
        return False
    return device_bytes is not None and logits_bytes <= FULL_LOGITS_MAX_SHARE * device_bytes


def cuda_memory_bytes(device: torch.device) -> int:
    """The CUDA device's total memory; a constant to torch.compile (read once while tracing, no graph break)."""
    return torch.cuda.get_device_properties(device).total_memory


# What @torch.compiler.assume_constant_result sets, without the import of torch._dynamo that decorator makes: 1.9 s
# of every process's start-up, eager ones included (tests/modeling/test_fused_ce.py checks the mark is torch's).
cuda_memory_bytes._dynamo_marked_constant = True  # type: ignore[attr-defined]


def full_logits_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """F.cross_entropy(h @ weight.T, targets): the plain form, which builds the (N, V) logits."""
    return F.cross_entropy(h @ weight.t(), targets, ignore_index=ignore_index)


def linear_cross_entropy(
    h: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100, fp8: bool = False
) -> Tensor:
    """The training loss: mean cross-entropy of the logits h @ weight.T over the targets that are not ignore_index,
    in the form takes_full_logits picks for this device, mode (eager or compiled) and size. fp8: the full logits,
    where that form is taken, from an FP8 matmul (modeling.fp8_head); the fused form ignores it."""
    device = h.device
    autocast = torch.is_autocast_enabled(device.type)
    compute_dtype = torch.get_autocast_dtype(device.type) if autocast else h.dtype
    logits_bytes = h.shape[0] * weight.shape[0] * compute_dtype.itemsize
    device_bytes = cuda_memory_bytes(device) if device.type == "cuda" else None
    if takes_full_logits(device.type, torch.compiler.is_compiling(), logits_bytes, device_bytes):
        if fp8:
            return F.cross_entropy(fp8_logits(h, weight).float(), targets, ignore_index=ignore_index)
        return full_logits_cross_entropy(h, weight, targets, ignore_index)
    return fused_linear_cross_entropy(h, weight, targets, ignore_index)


def fused_linear_cross_entropy(
    h: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100, chunk_rows: int = CHUNK_ROWS
) -> Tensor:
    """Mean cross-entropy of logits h @ weight.T, equal to F.cross_entropy(h @ weight.T, targets) in value
    and gradients. h: (N, E) hidden states, weight: (V, E) head, targets: (N,) ids or ignore_index.
    Under no_grad (evaluation) only the loss is computed, a third of the matmul work.

    Under fp16 autocast it is F.cross_entropy over the full logits: fp16 cannot hold gradients computed before
    the loss scale (GradScaler's grad_output) is known, as small probabilities times 1/tokens underflow."""
    device_type = h.device.type
    autocast = torch.is_autocast_enabled(device_type)
    compute_dtype = torch.get_autocast_dtype(device_type) if autocast else h.dtype
    if compute_dtype == torch.float16:
        return full_logits_cross_entropy(h, weight, targets, ignore_index)
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
