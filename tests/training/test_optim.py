"""Schedule shapes, and the optimizers against plain torch twins."""

import copy
import io
import math

import pytest
import torch

from modeling.config import REAL_VOCAB_SIZE, get_preset
from modeling.gpt import GPT
from training import optim
from training.config import TrainConfig
from training.loop import budget_steps
from training.optim import (
    AdamWWithMuon,
    Schedule,
    build_optimizer,
    build_scheduler,
    decay_start,
    lr_multiplier,
    newton_schulz,
)


def test_warmup_is_linear_then_cosine_reaches_floor():
    cfg = TrainConfig(lr_schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_multiplier(0, cfg, 110) == pytest.approx(0.1)
    assert lr_multiplier(9, cfg, 110) == pytest.approx(1.0)
    assert lr_multiplier(10, cfg, 110) == pytest.approx(1.0)
    assert lr_multiplier(60, cfg, 110) == pytest.approx(0.55)  # halfway through the cosine
    assert lr_multiplier(110, cfg, 110) == pytest.approx(0.1)
    values = [lr_multiplier(s, cfg, 110) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_scheduler_drives_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = build_optimizer([{"params": [p], "weight_decay": 0.1}], lr=1e-3, betas=(0.9, 0.95), device_type="cpu")
    sched = build_scheduler(opt, TrainConfig(lr_schedule="cosine", warmup_steps=4, max_steps=8, min_lr_ratio=0.0))
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


WSD = dict(lr_schedule="wsd", warmup_steps=10, min_lr_ratio=0.1, decay_fraction=0.2)


def test_the_default_schedule_is_the_configs_recipe():
    """build_scheduler takes the schedule from the run config alone: TrainConfig's defaults (wsd: the peak lr until
    the last decay_fraction of the steps) are the one recipe, not a second set of defaults of its own."""
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = build_optimizer([{"params": [p], "weight_decay": 0.1}], lr=1.0, betas=(0.9, 0.95), device_type="cpu")
    cfg = TrainConfig(max_steps=100)
    sched = build_scheduler(opt, cfg)
    assert cfg.lr_schedule == "wsd" and sched.lrs_of_step(80) == [1.0]
    assert sched.lrs_of_step(100) == [pytest.approx(cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) / 20)]


def test_wsd_warms_up_holds_then_decays_linearly_to_the_floor():
    cfg = TrainConfig(**WSD)
    values = [lr_multiplier(s, cfg, 100) for s in range(101)]
    assert values[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])  # the same warmup as cosine
    assert values[9:81] == [1.0] * 72  # stable up to the last 20 steps
    assert values[90] == pytest.approx(0.55)  # halfway down the line
    assert values[99] == pytest.approx(0.1 + 0.9 / 20)  # the last update's lr, one step above the floor
    assert values[100] == pytest.approx(0.1) and lr_multiplier(150, cfg, 100) == pytest.approx(0.1)
    steps = [b - a for a, b in zip(values[80:], values[81:])]
    assert steps == pytest.approx([-0.9 / 20] * 20)  # a straight line


def test_wsd_edge_cases_stay_continuous_and_monotone():
    never = TrainConfig(**{**WSD, "decay_fraction": 0.0})
    assert {lr_multiplier(s, never, 100) for s in range(10, 100)} == {1.0}  # never decays
    # nor past its end: the next step of the stable run, which its anneal trains, is at the peak (not the floor a
    # decayed run ends at: a resume read it as decayed and warned the lr went back up)
    assert lr_multiplier(100, never, 100) == lr_multiplier(150, never, 100) == 1.0
    # a decay longer than the run after warmup: the warmup ramp meets the line, never jumping back up
    short = TrainConfig(**{**WSD, "decay_fraction": 1.0})
    values = [lr_multiplier(s, short, 12) for s in range(13)]
    assert max(values) < 1.0 and values[-1] == pytest.approx(0.1)
    peak = values.index(max(values))
    assert values[: peak + 1] == sorted(values[: peak + 1]) and values[peak:] == sorted(values[peak:], reverse=True)


def test_wsd_decay_steps_give_the_decay_in_steps_whatever_the_fraction():
    """--decay-steps 4 of 14: peak up to and including the 4th-last step, then the line of a 4-step decay; no
    rounding of a fraction (4/14 typed as 0.29 would start the decay below the peak)."""
    anneal = TrainConfig(**{**WSD, "warmup_steps": 2, "decay_steps": 4})
    values = [lr_multiplier(s, anneal, 14) for s in range(14)]
    assert values[1:11] == [1.0] * 10
    assert values[10:] == pytest.approx([1.0, 0.1 + 0.9 * 3 / 4, 0.1 + 0.9 * 2 / 4, 0.1 + 0.9 / 4])


@pytest.mark.parametrize("warmup", [0, 2, 20])
@pytest.mark.parametrize("fraction, steps", [(0.2, 0), (1 / 3, 0), (0.1, 0), (1.0, 0), (0.2, 3), (0.0, 7)])
def test_the_steps_before_a_wsd_decay_have_the_lrs_of_any_longer_run(warmup, fraction, steps):
    """decay_start(total): the first step whose lr a run of `total` steps decays below a longer run's, for every total
    up to 300, the float fractions included (0.2 x 12 is 2.4000000000000004), short runs whose decay starts inside
    the warmup, and none where no step is before the decay (a decay over the whole run) or none decays."""
    cfg = TrainConfig(**{**WSD, "warmup_steps": warmup, "decay_fraction": fraction, "decay_steps": steps})
    found = 0
    for total in range(1, 301):
        start = decay_start(cfg, total)
        for longer in (total + 1, 2 * total + 7):
            same = [lr_multiplier(s, cfg, total) == lr_multiplier(s, cfg, longer) for s in range(total)]
            first_other = same.index(False) if False in same else None
            assert start == (first_other or None), (total, longer, start, first_other)
        found += start is not None
    assert found > (0 if fraction in (0.0, 1.0) else 250)  # a real decay start in nearly every run


def test_a_cosine_schedule_has_no_step_before_its_decay():
    assert {decay_start(TrainConfig(lr_schedule="cosine", warmup_steps=2), total) for total in range(1, 50)} == {None}


def train(model: GPT, optimizers: list, schedulers: list, batches: torch.Generator, steps: int) -> None:
    """`steps` optimizer steps on random token batches drawn from `batches`."""
    for _ in range(steps):
        idx = torch.randint(0, REAL_VOCAB_SIZE, (2, 32), generator=batches)
        model(idx[:, :-1], idx[:, 1:])[1].backward()
        for o in optimizers:
            o.step()
        for s in schedulers:
            s.step()
        for o in optimizers:
            o.zero_grad(set_to_none=True)


SCHEDULE = TrainConfig(lr_schedule="wsd", warmup_steps=2, max_steps=6, min_lr_ratio=0.1, decay_fraction=0.5)


def muon_run(model: GPT, momentum_warmup: int = 0, mixed_precision: str = "no") -> tuple[AdamWWithMuon, Schedule]:
    optimizer = build_optimizer(model.optimizer_groups(0.1, muon=True), lr=3e-3, betas=(0.9, 0.95),
                                device_type="cpu", muon_lr=0.02, muon_momentum=0.9,
                                mixed_precision=mixed_precision)  # fmt: skip
    cfg = SCHEDULE.replace(muon_momentum_warmup_steps=momentum_warmup)
    return optimizer, build_scheduler(optimizer, cfg)


@pytest.mark.parametrize("batch_elements", [optim.MAX_BATCH_ELEMENTS, 3 * 64 * 64], ids=["one-batch-a-shape", "split"])
def test_muon_for_block_matrices_with_adamw_matches_the_two_torch_optimizers_by_hand(batch_elements, monkeypatch):
    """build_optimizer's one object, in a bf16 run, == torch.optim.Muon on the blocks' matrices + AdamW on the
    rest, each with its own LambdaLR, stepped side by side (the update acts on fp32 master weights in every
    precision). Each group must be in its optimizer (a wrong one would change the update) and scheduled from its
    own peak lr. Ours iterates Newton-Schulz on batches of same-shaped matrices, torch's matrix by matrix: each
    shape's matrices in one batch, or split over batches of at most 3 64 x 64 matrices' elements (1 or 3 a batch)."""
    monkeypatch.setattr(optim, "MAX_BATCH_ELEMENTS", batch_elements)
    torch.manual_seed(0)
    model = GPT(get_preset("tiny-cpu"))
    start, twin = copy.deepcopy(model.state_dict()), copy.deepcopy(model)
    ours, schedule = muon_run(model, mixed_precision="bf16")
    assert isinstance(ours, AdamWWithMuon) and [g["name"] for g in ours.param_groups] == ["decay", "no_decay", "muon"]
    train(model, [ours], [schedule], torch.Generator().manual_seed(0), steps=5)

    blocks = {n: p for n, p in twin.named_parameters() if n.startswith("transformer.h.") and p.dim() == 2}
    rest = [p for n, p in twin.named_parameters() if n not in blocks]
    muon = torch.optim.Muon(blocks.values(), lr=0.02, momentum=0.9, weight_decay=0.1)
    adamw = torch.optim.AdamW(
        [{"params": [p for p in rest if p.dim() == 2], "weight_decay": 0.1},
         {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
        lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=True,  # as ours (fused vs foreach: test above)
    )  # fmt: skip
    schedules = [build_scheduler(o, SCHEDULE) for o in (muon, adamw)]
    train(twin, [muon, adamw], schedules, torch.Generator().manual_seed(0), steps=5)

    trained = dict(twin.named_parameters())
    assert len(blocks) == 4 * get_preset("tiny-cpu").n_layer
    for name, p in model.named_parameters():
        assert not torch.equal(p, start[name]), name  # every tensor trained
        assert torch.equal(p, trained[name]), name  # the same updates on the same gradients, bit for bit
    peak = lr_multiplier(5, SCHEDULE, 6)  # one schedule scales each group from its own peak
    assert [g["lr"] for g in ours.param_groups] == pytest.approx([3e-3 * peak] * 2 + [0.02 * peak])


def newton_schulz_inputs() -> dict[str, torch.Tensor]:
    """Momentum-smoothed updates as long training has them: tall and wide, a few directions dominating (singular
    values over 4 decades), and tiny (late in a decay, whose Frobenius norm is still above Muon's eps)."""
    g = torch.Generator().manual_seed(0)

    def spectrum(rows: int, cols: int, scale: float) -> torch.Tensor:
        u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=g, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=g, dtype=torch.float64))
        k = min(rows, cols)
        return scale * (u[:, :k] * torch.logspace(0, -4, k, dtype=torch.float64)) @ v[:, :k].T

    return {
        "tall 384x128, random": torch.randn(384, 128, generator=g, dtype=torch.float64),
        "wide 128x512, 4 decades": spectrum(128, 512, 1.0),
        "tall 512x128, 4 decades, tiny": spectrum(512, 128, 1e-5),
    }


@pytest.mark.parametrize("name", list(newton_schulz_inputs()))
def test_newton_schulz_in_fp32_is_close_to_fp64_and_far_closer_than_torchs_bf16(name):
    """fp32 runs (the CPUs whose bf16 is emulated, fp16 GPUs) keep Muon's orthogonalization within 1e-5 of the
    same iteration in fp64, thousands of times closer than bf16 (torch's dtype, kept for bf16 runs), on the same
    fp32 input."""
    update = newton_schulz_inputs()[name].float()
    coefficients, steps, eps = (3.4445, -4.7750, 2.0315), 5, 1e-7  # torch.optim.Muon's defaults
    exact = newton_schulz([update.double()], coefficients, steps, eps, torch.float64)[0]
    fp32 = newton_schulz([update], coefficients, steps, eps, torch.float32)[0]
    bf16 = newton_schulz([update], coefficients, steps, eps, torch.bfloat16)[0]
    assert fp32.dtype == torch.float32 and fp32.shape == update.shape
    fp32_error = (fp32.double() - exact).abs().max().item()
    bf16_error = (bf16.double() - exact).abs().max().item()
    assert torch.linalg.matrix_norm(exact, ord=2) > 0.5  # an orthogonalized update, whatever the input's scale
    assert fp32_error < 1e-5 and fp32_error < bf16_error / 100, (fp32_error, bf16_error)


@pytest.mark.parametrize(
    ("dtype", "threads"),
    [(torch.float32, 1), (torch.bfloat16, 1), (torch.float32, 2)],
    ids=["fp32", "bf16", "fp32-2threads"],
)
def test_newton_schulz_on_a_batch_equals_each_matrix_alone_and_leaves_its_input(dtype, threads):
    """A batch's matrices (each with its own scale: one norm per matrix) come out as each alone, bit for bit on the
    CPU at one thread; with more, the batched fp32 baddbmm sums in another order than one matrix's (it equals
    neither addmm nor bmm-then-add there), so within fp32 rounding. The updates passed in are not written to
    (without Nesterov the update is the momentum buffer)."""
    g = torch.Generator().manual_seed(0)
    updates = [torch.randn(384, 128, generator=g) * scale for scale in (1.0, 1e-3, 30.0)]
    before = [u.clone() for u in updates]
    coefficients, steps, eps = (3.4445, -4.7750, 2.0315), 5, 1e-7
    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = newton_schulz(updates, coefficients, steps, eps, dtype)
        alone = [newton_schulz([update], coefficients, steps, eps, dtype)[0] for update in updates]
    finally:
        torch.set_num_threads(was)
    assert batch.shape == (3, 384, 128) and batch.dtype == dtype
    for result, one, update, kept in zip(batch, alone, updates, before, strict=True):
        if threads == 1:
            assert torch.equal(result, one)
        else:  # entries of an orthogonalized matrix are O(0.1): 1e-5 is ~100 fp32 roundings, 1/10 of one bf16's
            torch.testing.assert_close(result, one, rtol=0, atol=1e-5)
        assert torch.equal(update, kept)


def test_muon_steps_in_the_precision_of_the_run():
    """bf16 runs keep torch's bf16 Newton-Schulz; fp32 and fp16 runs (no fast bf16) get fp32, which trains the
    blocks differently from bf16 but within fp32 rounding of the same run in fp64 (5 steps on the tiny GPT)."""
    for precision, dtype in [("bf16", torch.bfloat16), ("no", torch.float32), ("fp16", torch.float32)]:
        groups = GPT(get_preset("tiny-cpu")).optimizer_groups(0.1, muon=True)  # optimizers fill in their groups
        optimizer = build_optimizer(groups, lr=3e-3, betas=(0.9, 0.95), device_type="cpu", mixed_precision=precision)
        assert optimizer.muon.ns_dtype == dtype, precision
    torch.manual_seed(0)
    runs = {precision: GPT(get_preset("tiny-cpu")) for precision in ("bf16", "no")}
    runs["no"].load_state_dict(runs["bf16"].state_dict())
    exact = copy.deepcopy(runs["no"]).double()
    for precision, model in runs.items():
        optimizer, schedule = muon_run(model, mixed_precision=precision)
        train(model, [optimizer], [schedule], torch.Generator().manual_seed(0), steps=5)
    optimizer, schedule = muon_run(exact)
    optimizer.muon.ns_dtype = torch.float64
    train(exact, [optimizer], [schedule], torch.Generator().manual_seed(0), steps=5)
    reference, bf16 = dict(exact.named_parameters()), dict(runs["bf16"].named_parameters())
    for name, p in runs["no"].named_parameters():
        if name.startswith("transformer.h.") and p.dim() == 2:  # Muon's
            fp32_error = (p.double() - reference[name]).abs().max().item()
            bf16_error = (bf16[name].double() - reference[name]).abs().max().item()
            assert fp32_error < 1e-5 and fp32_error < bf16_error / 10, (name, fp32_error, bf16_error)


def test_muon_momentum_warms_up_linearly_and_adamw_is_left_alone():
    p, q = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))
    groups = [{"name": "no_decay", "params": [q], "weight_decay": 0.0}, {"name": "muon", "params": [p]}]
    optimizer = build_optimizer(groups, lr=1e-3, betas=(0.9, 0.95), device_type="cpu", muon_momentum=0.95)
    cfg = TrainConfig(warmup_steps=0, max_steps=10, min_lr_ratio=0.0, muon_momentum_warmup_steps=4)
    schedule = build_scheduler(optimizer, cfg)
    momenta = []
    for _ in range(6):
        momenta.append(optimizer.param_groups[-1]["momentum"])
        schedule.step()
    assert momenta == pytest.approx([0.85, 0.875, 0.9, 0.925, 0.95, 0.95])
    assert "momentum" not in optimizer.param_groups[0] and optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    groups = [{"name": "no_decay", "params": [q], "weight_decay": 0.0}, {"name": "muon", "params": [p]}]
    low = build_optimizer(groups, lr=1e-3, betas=(0.9, 0.95), device_type="cpu", muon_momentum=0.5)
    build_scheduler(low, cfg)
    assert low.param_groups[-1]["momentum"] == 0.5  # a peak below 0.85 is held from the start


def test_muon_state_dict_resumes_exactly():
    """3 steps, state_dict of optimizer and schedule through torch.save, a fresh build loading them, 2 more steps
    == 5 straight steps, bit for bit (what accelerate's save_state / load_state do with it), also in the middle of
    the momentum warmup."""
    torch.manual_seed(0)
    straight = GPT(get_preset("tiny-cpu"))
    resumed = copy.deepcopy(straight)
    optimizer, schedule = muon_run(straight, momentum_warmup=4)
    train(straight, [optimizer], [schedule], torch.Generator().manual_seed(0), steps=5)

    batches = torch.Generator().manual_seed(0)
    optimizer, schedule = muon_run(resumed, momentum_warmup=4)
    train(resumed, [optimizer], [schedule], batches, steps=3)
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert set(saved["optimizer"]) == {"adamw", "muon"} and saved["optimizer"]["muon"]["state"]
    optimizer, schedule = muon_run(resumed, momentum_warmup=4)
    optimizer.load_state_dict(saved["optimizer"])
    schedule.load_state_dict(saved["schedule"])
    train(resumed, [optimizer], [schedule], batches, steps=2)
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def muon_schedule(schedule: str, total: int) -> tuple[torch.optim.Optimizer, Schedule]:
    p, q = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))
    groups = [{"name": "no_decay", "params": [q], "weight_decay": 0.0}, {"name": "muon", "params": [p]}]
    optimizer = build_optimizer(groups, lr=3e-3, betas=(0.9, 0.95), device_type="cpu", muon_lr=0.02)
    cfg = TrainConfig(lr_schedule=schedule, warmup_steps=4, max_steps=total, min_lr_ratio=0.1)
    return optimizer, build_scheduler(optimizer, cfg)


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_a_schedule_spanned_at_the_end_of_the_warmup_equals_one_built_for_that_total(schedule):
    """A time budget decides the step count at the end of the warmup (Schedule.span): from then on, and for the
    steps before, every group's lr is the one a schedule built for that total from the start gives."""

    def lrs(total: int, span_at: int | None, steps: int) -> list[list[float]]:
        optimizer, sched = muon_schedule(schedule, total)
        seen = []
        for step in range(steps):
            if step == span_at:
                sched.span(17)
            seen.append([g["lr"] for g in optimizer.param_groups])
            optimizer.step()
            sched.step()
        return seen

    spanned, built = lrs(300, 4, 20), lrs(17, None, 20)
    assert spanned == built  # exactly: the same multiplier at every step
    assert spanned != lrs(300, None, 20)  # and not the 300-step schedule's


def test_a_wsd_run_respanned_before_its_decay_equals_one_built_for_the_final_total():
    """A time budget re-times the run at log steps: under wsd, any total that keeps the steps taken in the stable
    phase is taken, and the lrs of the whole run are those of a schedule built for the last total."""
    optimizer, sched = muon_schedule("wsd", 100)
    seen, total = [], 100
    for step in range(22):
        if step in (4, 10, 20):
            total = sched.nearest_span({4: 60, 10: 30, 20: 22}[step], total)
            sched.span(total)
        seen.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        sched.step()
    assert total == 24  # 22 or 23 would have put step 19 in the decay (1 or 4 steps to go of 4.4 or 4.6)
    optimizer, built = muon_schedule("wsd", 24)
    expected = []
    for _ in range(22):
        expected.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        built.step()
    assert seen == expected
    assert not sched.keeps_past(25)  # in the decay now: the count is final


def test_a_cosine_run_keeps_its_total_after_the_warmup():
    optimizer, sched = muon_schedule("cosine", 100)
    for _ in range(3):
        optimizer.step()
        sched.step()
    assert sched.nearest_span(50, 100) == 50  # all steps so far in the warmup
    for _ in range(3):
        optimizer.step()
        sched.step()
    assert not sched.keeps_past(101) and sched.nearest_span(50, 100) == 100


def test_budget_steps_fit_the_minutes_left_within_the_cap():
    assert budget_steps(5, 1.5, elapsed_s=9, done=6, cap=300) == 200
    assert budget_steps(5, 1.5, elapsed_s=150, done=100, cap=300) == 200  # re-timed: 150 s left at 1.5 s a step
    assert budget_steps(5, 0.5, elapsed_s=3, done=6, cap=300) == 300  # capped by max_steps
    assert budget_steps(0.1, 3.0, elapsed_s=18, done=6, cap=300) == 6  # slower than the budget: stop where it is


def test_the_lrs_of_a_step_are_those_its_update_used():
    """metrics.jsonl's lr at step N is the lr step N's update used (get_last_lr() after it is step N+1's)."""
    optimizer, sched = muon_schedule("wsd", 30)
    for step in range(1, 31):
        used = [g["lr"] for g in optimizer.param_groups]
        optimizer.step()
        sched.step()
        if step == 4:
            sched.span(sched.nearest_span(20, 30))  # a time budget's decision, as the run takes it
        assert sched.lrs_of_step(step) == used, step
    assert sched.lrs_of_step(1) != sched.lrs_of_step(2)  # the warmup
