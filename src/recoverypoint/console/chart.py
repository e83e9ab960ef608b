"""The overview's chart: keys finished and abandoned per hour over the last 24 hours, as
an inline SVG drawn on the server (no script, no image request). Built from numbers and
times only, so nothing a client sent can reach the markup."""

from __future__ import annotations

from collections.abc import Sequence

from markupsafe import Markup

from ..admin import Hour

WIDTH, HEIGHT, LEFT, BOTTOM, TOP = 720, 180, 44, 22, 10


def hours_chart(hours: Sequence[Hour]) -> Markup:
    peak = max((h.finished + h.abandoned for h in hours), default=0) or 1
    plot = HEIGHT - BOTTOM - TOP
    slot = (WIDTH - LEFT) / max(len(hours), 1)
    parts = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        'aria-labelledby="chart-title" xmlns="http://www.w3.org/2000/svg">',
        '<title id="chart-title">Keys finished and abandoned per hour, last 24 hours</title>',
        f'<line class="axis" x1="{LEFT}" y1="{TOP + plot}" x2="{WIDTH}" y2="{TOP + plot}"/>',
        f'<text class="tick" x="{LEFT - 6}" y="{TOP + 4}" text-anchor="end">{peak}</text>',
        f'<text class="tick" x="{LEFT - 6}" y="{TOP + plot}" text-anchor="end">0</text>',
    ]
    for index, hour in enumerate(hours):
        x = LEFT + index * slot + 2
        done = plot * hour.finished / peak
        failed = plot * hour.abandoned / peak
        label = f"{hour.start:%H}:00 UTC: {hour.finished} finished, {hour.abandoned} abandoned"
        parts.append(f"<g><title>{label}</title>")
        parts.append(_bar("finished", x, TOP + plot - done, slot - 4, done))
        parts.append(_bar("abandoned", x, TOP + plot - done - failed, slot - 4, failed))
        parts.append("</g>")
        if index % 6 == 0 or index == len(hours) - 1:
            parts.append(
                f'<text class="tick" x="{x + (slot - 4) / 2:.1f}" y="{HEIGHT - 6}" '
                f'text-anchor="middle">{hour.start:%H}:00</text>'
            )
    parts.append("</svg>")
    return Markup("".join(parts))


def _bar(kind: str, x: float, y: float, width: float, height: float) -> str:
    return (
        f'<rect class="{kind}" x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" '
        f'height="{max(height, 0):.1f}"/>'
    )
