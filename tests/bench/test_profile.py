"""bench.profile's matmul bound: the profiled matmuls are found with their layouts, and each is timed as it ran; the
CPU named precisely in every figure."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from bench.profile import (
    ATTENTION,
    BF16_MATH,
    LOSS_SOFTMAX,
    MUON_STEP,
    ONEDNN_LINEAR,
    kind_of,
    matmul_calls,
    print_matmul_bound,
    time_matmul,
)
from bench.rungs import REPO, full_recipe_trainer, launch_config
from modeling import cpu_linear
from modeling.config import get_preset
from modeling.cpu_attention import causal_attention
from modeling.device import cpu_model


def recorded_layouts(calls: dict[tuple, tuple[int, float]]) -> bool:
    """Whether the profiler recorded each matmul's input strides and dtypes, which timing it alone needs (torch 2.13
    does; torch 2.11, the GPU machines' image, does not, and the report then times none alone)."""
    return all(strides is not None for _, _, strides, _ in calls)


def skip_without_layouts(calls: dict[tuple, tuple[int, float]]) -> None:
    if not recorded_layouts(calls):
        pytest.skip(f"torch {torch.__version__}'s profiler records no input strides or dtypes: no matmul timed alone")


def test_the_matmuls_of_a_step_are_found_with_their_layout_and_timed_alone():
    """A linear layer's forward and backward run three matmuls per step; each is found once per step (over two
    profiled steps) with its shapes, strides and dtype, and timing it alone computes the same product."""
    layer = torch.nn.Linear(16, 8, bias=False)
    x = torch.randn(32, 16, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(2):
            layer(x).square().sum().backward()
    calls = matmul_calls(prof, steps=2)
    assert sorted((op, shapes) for op, shapes, _, _ in calls) == sorted(
        [
            ("aten::mm", ((32, 16), (16, 8))),  # forward: x @ W.T
            ("aten::mm", ((32, 8), (8, 16))),  # grad_x = grad_y @ W
            ("aten::mm", ((8, 32), (32, 16))),  # grad_W = grad_y.T @ x
        ]
    )
    assert {count for count, _ in calls.values()} == {1}
    assert all(ms > 0 for _, ms in calls.values())  # each call's time within the step
    skip_without_layouts(calls)
    forward = next(k for k in calls if k[1] == ((32, 16), (16, 8)))
    assert forward[2] == ((16, 1), (1, 16))  # W.T: a transposed view, timed as such
    assert forward[3] == ("float", "float")
    ms, gflop = time_matmul(*forward, repeats=2)
    assert ms > 0
    assert gflop == pytest.approx(2 * 32 * 16 * 8 / 1e9)


def test_the_cpu_attention_matmuls_are_timed_in_its_bf16_math_mode():
    """modeling.cpu_attention's bf16 products are aten::bmm calls on fp32 tensors inside its op: timed alone as plain
    fp32 bmm they would be charged at MKL's fp32 speed, so they are marked and timed through the op."""
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        causal_attention(q, k, v).sum().backward()
    calls = matmul_calls(prof, steps=1)
    assert sum(count for count, _ in calls.values()) == 6  # scores and output forward; four products backward
    assert {op for op, *_ in calls} == {f"aten::bmm ({BF16_MATH})"}
    skip_without_layouts(calls)
    op, shapes, strides, dtypes = next(iter(calls))
    assert time_matmul(op, shapes, strides, dtypes, repeats=1)[1] == pytest.approx(2 * 2 * 16 * 16 * 8 / 1e9)


def test_the_onednn_linears_are_found_and_timed_alone(monkeypatch: pytest.MonkeyPatch):
    """fp32 linears on AVX-512 AMD CPUs (modeling.cpu_linear, forced on here) run oneDNN's op, not aten::mm: its three
    products per step are matmuls of the bound too, each timed alone with its bias where it has one."""
    monkeypatch.setattr(cpu_linear, "ONEDNN_FP32", True)
    layer = cpu_linear.Linear(16, 8)
    x = torch.randn(32, 16, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        layer(x).square().sum().backward()
    calls = matmul_calls(prof, steps=1)
    assert sorted((op, shapes) for op, shapes, _, _ in calls) == [
        (ONEDNN_LINEAR, ((8, 32), (16, 32))),  # grad_W = grad_y.T @ x: the wider of in and out as its columns
        (ONEDNN_LINEAR, ((32, 8), (16, 8))),  # grad_x = grad_y @ W
        (ONEDNN_LINEAR, ((32, 16), (8, 16), (8,))),  # forward: x @ W.T + b
    ]
    skip_without_layouts(calls)
    forward = next(k for k in calls if len(k[1]) == 3)
    assert time_matmul(*forward, repeats=1)[1] == pytest.approx(2 * 32 * 16 * 8 / 1e9)


def test_without_recorded_layouts_the_matmuls_are_reported_as_they_ran_in_the_step(capsys: pytest.CaptureFixture[str]):
    """torch 2.11 (the GPU machines' image, beside an AMX Xeon) records no input strides or dtypes: the table still
    lists each matmul with its calls and time within the step, and says why none is timed alone."""
    layer = torch.nn.Linear(16, 8, bias=False)
    x = torch.randn(32, 16, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        layer(x).square().sum().backward()
    calls = matmul_calls(prof, steps=1)
    if recorded_layouts(calls):  # torch 2.13: timed alone, the bound's sum
        print_matmul_bound(calls, in_step_ms=1.0, step_ms=2.0)
        assert "take" in capsys.readouterr().out.splitlines()[-1]
    as_on_torch_2_11 = {(op, shapes, None, None): value for (op, shapes, _, _), value in calls.items()}
    print_matmul_bound(as_on_torch_2_11, in_step_ms=1.0, step_ms=2.0)
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| aten::mm ")]
    assert len(rows) == 3 and all(line.endswith("|  |  |") for line in rows), out
    assert "not timed alone, as torch" in out.splitlines()[-1]


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("aten::mm", "matmul (mm, addmm, bmm)"),
        ("graph_0_cpp_fused__to_copy_add_amax_arange_clamp_div_eq_exp_gather_gt_log_log1p_mul_native", LOSS_SOFTMAX),
        ("bookgpt::softmax_grad_", LOSS_SOFTMAX),
        ("graph_0_cpp_fused__to_copy_add_arange_div_expand_gt_mul_neg_scalar_tensor_sum_transpose_un", ATTENTION),
        ("graph_0_cpp_fused__to_copy_add_native_layer_norm_native_layer_norm_backward_view_12", "LayerNorm (inductor)"),
        ("graph_0_cpp_fused__to_copy_add_mul_sigmoid_view_3", "GELU (inductor)"),
        ("graph_0_cpp_fused__to_copy_add_mul_sigmoid_sigmoid_backward_sum_view_1", "GELU (inductor)"),
        ("aten::_fused_adamw_", "optimizer (AdamW)"),
        ("Optimizer.zero_grad#AdamW.zero_grad", "zeroing (fill_, zero_)"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", ATTENTION),
        ("graph_0_cpp_fused__softmax_gt_mul_scalar_tensor_unsqueeze_where_1", ATTENTION),
        ("graph_0_cpp_fused__softmax_backward_data_gt_mul_scalar_tensor_unsqueeze_where_4", ATTENTION),
    ],
)  # fmt: skip
def test_kernels_are_sorted_by_what_they_compute(name: str, kind: str):
    """Names as torch 2.13's profiler reports them for rung 11 (inductor kernels under enable_kernel_profile)."""
    assert kind_of(name) == kind


def test_the_cpu_is_named_with_its_family_and_matmul_isa(monkeypatch: pytest.MonkeyPatch):
    """Two VMs reporting the same bare 'AMD EPYC' (a Zen 3 and a Zen 4) are told apart in every figure's label."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    zen = "processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: {model}\nmodel name\t: AMD EPYC\n"
    zen3 = zen.format(n=0, model=1) + "flags\t\t: fpu sse avx avx2 fma\n\n"
    zen4 = "".join(zen.format(n=n, model=17) + "flags\t\t: avx2 avx512f avx512_bf16\n\n" for n in range(2))
    assert cpu_model(zen3) == "AMD EPYC (family 25 model 1, avx2)"
    assert cpu_model(zen4) == "AMD EPYC (family 25 model 17, avx512_bf16)"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu_model(zen4) == "AMD EPYC (family 25 model 17, avx512_bf16, capped at AVX2)"


def test_muons_step_is_found_in_the_profile_of_rung_11_with_its_newton_schulz_matmuls(fresh_accelerate_state):
    """`bench.profile --optimizer muon` reports Muon's share from the profiler's range around torch.optim.Muon.step:
    rung 11 built with Muon runs it (the name as this torch records it), and the Newton-Schulz products of the
    blocks' matrices run inside it, batched: X·Xᵀ of the 2 layers' 64×64 c_proj, 64×192 c_attn, 64×256 c_fc."""
    config = get_preset("tiny-cpu")
    launch = launch_config(REPO / "accelerate_configs" / "cpu_eager.yaml")
    trainer = full_recipe_trainer(config, torch.device("cpu"), 2, launch, None, "muon")
    x = torch.randint(0, 50_000, (2, config.block_size))
    trainer.step(x, x)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        trainer.step(x, x)
    muon = [e for e in prof.events() if e.name == MUON_STEP]
    assert len(muon) == 1 and muon[0].cpu_time_total > 0
    inside = {
        tuple(e.input_shapes[0]) for e in prof.events()
        if e.name in ("aten::bmm", "aten::baddbmm") and muon[0].time_range.start <= e.time_range.start
        and e.time_range.end <= muon[0].time_range.end and e.input_shapes and e.input_shapes[0]
    }  # fmt: skip
    assert {(config.n_layer, 64, 64), (config.n_layer, 64, 192), (config.n_layer, 64, 256)} <= inside
