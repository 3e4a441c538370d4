"""Schedule shape and the optimizer's parameter groups."""

import math

import pytest
import torch

from training.optim import build_optimizer, build_scheduler, lr_multiplier


def test_warmup_is_linear_then_cosine_reaches_floor():
    kw = dict(warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_multiplier(0, **kw) == pytest.approx(0.1)
    assert lr_multiplier(9, **kw) == pytest.approx(1.0)
    assert lr_multiplier(10, **kw) == pytest.approx(1.0)
    assert lr_multiplier(60, **kw) == pytest.approx(0.55)  # halfway through the cosine
    assert lr_multiplier(110, **kw) == pytest.approx(0.1)
    values = [lr_multiplier(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_scheduler_drives_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = build_optimizer([{"params": [p], "weight_decay": 0.1}], lr=1e-3, betas=(0.9, 0.95), device_type="cpu")
    sched = build_scheduler(opt, warmup_steps=4, total_steps=8, min_lr_ratio=0.0)
    lrs = []
    for _ in range(8):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lrs[6] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_fused_adamw_matches_foreach():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fused = build_optimizer([{"params": params, "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95), device_type="cpu")
    plain = torch.optim.AdamW([{"params": twins, "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95), foreach=True)
    assert fused.defaults["fused"]
    for _ in range(3):
        for group in (params, twins):
            for p in group:
                p.grad = torch.ones_like(p) * p.detach().sum().sign()
        fused.step()
        plain.step()
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q)
