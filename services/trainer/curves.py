"""Training curves: loss and per-position accuracy over steps, as a self-contained HTML page with inline SVG (no
plotting package needed), written next to each checkpoint."""

import math
from html import escape
from typing import Any

_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"]


def _svg_chart(title: str, steps: list[int], series: dict[str, list[float]], *, y_min: float | None = None) -> str:
    width, height, left, right, top, bottom = 720, 300, 60, 150, 30, 40
    values = [v for vs in series.values() for v in vs if math.isfinite(v)] or [0.0]
    lo = min(values) if y_min is None else y_min
    hi = max(max(values), lo + 1e-9)
    x_lo, x_hi = min(steps, default=0), max(max(steps, default=1), min(steps, default=0) + 1)

    def x(step: float) -> float:
        return left + (step - x_lo) / (x_hi - x_lo) * (width - left - right)

    def y(value: float) -> float:
        return top + (hi - value) / (hi - lo) * (height - top - bottom)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        f'font-size="11"><text x="{left}" y="18" font-size="13">{escape(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" fill="none" '
        'stroke="#999"/>',
    ]
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        value = lo + frac * (hi - lo)
        parts.append(f'<text x="{left - 4}" y="{y(value) + 4:.1f}" text-anchor="end">{value:.3g}</text>')
        step = x_lo + frac * (x_hi - x_lo)
        parts.append(f'<text x="{x(step):.1f}" y="{height - bottom + 15}" text-anchor="middle">{step:.0f}</text>')
    parts.append(f'<text x="{(width - right + left) / 2}" y="{height - 5}" text-anchor="middle">step</text>')
    for i, (name, vs) in enumerate(series.items()):
        color = _COLORS[i % len(_COLORS)]
        points = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in zip(steps, vs, strict=True) if math.isfinite(v))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}"/>')
        legend_y = top + 14 * i + 8
        legend_x = width - right + 10
        parts.append(
            f'<line x1="{legend_x}" y1="{legend_y}" x2="{legend_x + 20}" y2="{legend_y}" stroke="{color}" '
            'stroke-width="2"/>'
        )
        parts.append(f'<text x="{legend_x + 25}" y="{legend_y + 4}">{escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def curves_html(history: list[dict[str, Any]], title: str) -> str:
    """Loss and per-position accuracy over steps, as one self-contained HTML page."""
    steps = [h["step"] for h in history]
    positions = len(history[0]["step_accuracies"]) if history else 0
    loss = _svg_chart("TTT loss", steps, {"loss": [h["loss"] for h in history]})
    accuracy = _svg_chart(
        "top-1 accuracy per draft position",
        steps,
        {f"position {i}": [h["step_accuracies"][i] for h in history] for i in range(positions)},
        y_min=0.0,
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title></head>"
        f"<body><h3>{escape(title)}</h3>{loss}<br>{accuracy}</body></html>"
    )
