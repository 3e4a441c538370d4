"""The benchmarks' reports: their folder (made and checked before anything is measured), their files (written once
the results are on screen), and the ladder's summary lines, targets, Markdown table, profiles and bar chart."""

from __future__ import annotations

import sys
from pathlib import Path

from bench.measure import Result
from bench.rungs import Role
from evals.plot import png_bytes
from modeling.disk import DiskFull, atomic_write_bytes, cannot_write, disk_full_reported


def report_folder(out: Path) -> None:
    """Make --out before the measuring, whose minutes are lost if the report cannot be written at its end: one
    `error:` line where it cannot be made (a file there) or written (a read-only disk, another user's folder)."""
    made = None
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        made = err.strerror
    why = cannot_write(out / "report.json") or made  # a file the report writes in it
    if why:
        sys.exit(f"error: --out {out}: {why}; give a folder for the report")


def save_report(files: dict[Path, str | bytes]) -> None:
    """Write a report's files after its results are printed, each whole or not at all: a disk that fills up (checked
    writable at the start, but not for room) ends the benchmark with one `error:` line below the results, not a
    traceback that takes their place."""
    for path, data in files.items():
        try:
            with disk_full_reported(path, "the results are printed above"):
                atomic_write_bytes(path, data.encode() if isinstance(data, str) else data)
        except DiskFull as err:
            sys.exit(f"error: {err}")


def summary_line(r: Result) -> str:
    prefix = "" if r.role is Role.PEER else "rung "
    if r.status != "ok":
        return f"{prefix}{r.label} {r.name}: {r.reason}"
    compile_s = f", compile {r.compile_s:.1f} s" if r.compile_s is not None else ""
    return (
        f"{prefix}{r.label} {r.name}: {r.tok_s:,.0f} tok/s, {r.step_ms:.0f} ms/step "
        f"(B={r.micro_batch_size}){compile_s}, loss {r.first_loss:.3f}"
    )


def target_lines(rows: list[Result], measured_bf16_tflops: float | None = None) -> list[str]:
    """The ladder's targets: the full recipe >= 5x rung 0 and >= 1.5x the best peer (as published), all from this
    one run; without a target, the ratio to the peer at rung 11's precision; and, given the bf16 matmul peak measured
    on this GPU, the full recipe's MFU against it (target >= 55%)."""
    measured = [r for r in rows if r.status == "ok"]
    full = next((r for r in measured if r.role is Role.FULL_RECIPE), None)
    baseline = next((r for r in measured if r.role is Role.BASELINE), None)
    peers = [r for r in measured if r.role is Role.PEER]
    if full is None:
        return []
    lines = []
    checks: list[tuple[str, Result, float | None]] = []
    if baseline is not None:
        checks.append((f"rung {baseline.label}", baseline, 5.0))
    published = [r for r in peers if r.as_published]
    if published:
        best = max(published, key=lambda r: r.tok_s or 0.0)
        checks.append((f"best peer ({best.name})", best, 1.5))
    checks += [(f"peer at rung 11's precision ({r.name})", r, None) for r in peers if not r.as_published]
    for what, other, target in checks:
        ratio = (full.tok_s or 0.0) / (other.tok_s or 1.0)
        if target is None:
            lines.append(f"full recipe / {what}: {ratio:.2f}x (no target: not the peer's own recipe)")
        else:
            lines.append(f"full recipe / {what}: {ratio:.2f}x (target >= {target}x): {verdict(ratio >= target)}")
    if measured_bf16_tflops and full.model_tflops:
        mfu = full.model_tflops / measured_bf16_tflops
        lines.append(
            f"full recipe MFU against the measured bf16 matmul peak ({measured_bf16_tflops:.0f} TFLOP/s): {mfu:.1%} "
            f"(target >= 55%): {verdict(mfu >= 0.55)}"
        )
    return lines


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def markdown_table(rows: list[Result]) -> str:
    baseline = next((r for r in rows if r.role is Role.BASELINE and r.status == "ok"), None)
    lines = [
        "| rung | change | tok/s | × rung 0 | step ms | peak mem GiB | MFU | compile s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        change = f"**{r.name}**: {r.change}"
        if r.status != "ok":
            lines.append(f"| {r.label} | {change} ({r.reason}) | n/a | n/a | n/a | n/a | n/a | |")
            continue
        notes = "".join(f"; {n}" for n in r.notes)
        ratio = f"{r.tok_s / baseline.tok_s:.2f}×" if baseline and r.tok_s else ""
        compile_s = f"{r.compile_s:.1f}" if r.compile_s is not None else ""
        lines.append(
            f"| {r.label} | {change} (B={r.micro_batch_size}{notes}) | {r.tok_s:,.0f} | {ratio} | {r.step_ms:.0f} | "
            f"{r.peak_mem_gib:.2f} | {r.mfu:.1%} | {compile_s} |"
        )
    return "\n".join(lines)


def profile_markdown(rows: list[Result], top: int = 12) -> str:
    parts = []
    for r in rows:
        if not r.profile:
            continue
        parts.append(f"Top ops by self time, {r.label} {r.name} (ms per step, share of the step's op time):\n")
        parts.append("| op | ms/step | share | calls/step |\n|---|---:|---:|---:|")
        parts += [f"| {o['op']} | {o['ms_per_step']:.1f} | {o['share']:.1%} | {o['calls']} |" for o in r.profile[:top]]
        parts.append("")
    return "\n".join(parts)


def plot(rows: list[Result], title: str) -> bytes:
    """The ladder's bar chart of tokens/s, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.name if r.role is Role.PEER else f"{r.label} {r.name}" for r in rows]
    values = [r.tok_s or 0.0 for r in rows]
    color = {Role.PEER: "tab:orange", Role.FULL_RECIPE: "tab:green"}
    colors = [color.get(r.role, "tab:blue") for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(rows) + 1.5))
    bars = ax.barh(labels, values, color=colors)
    for bar, r in zip(bars, rows):
        text = f" {r.tok_s:,.0f}" if r.status == "ok" else " n/a"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, text, va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens / s (median step)")
    ax.set_title(title, fontsize=10)
    ax.margins(x=0.15)
    fig.tight_layout()
    return png_bytes(fig)
