"""The one curve fit of every cost model, and the check of a measured table before it is stored.

* ``interp``: piecewise-linear through sorted points (linear extrapolation at both ends, never below 0);
* ``monotone``: isotonic regression (pool adjacent violators), so verifying or drafting more rows never costs less
  and a noisy bump is averaged with its neighbours instead of lifting every wider point;
* ``suspect_points``: the points of a measured table (width x context bucket) that break what a step's cost must do,
  within a tolerance: grow with the width (more rows) and not fall with the context (more keys to attend to). A
  noisy minute during a measurement shows up as such a point (one verified row dearer at a short context than at a
  longer one), and the measuring harness (``pipeline.timing``) times those again.

Standard library only.
"""

from __future__ import annotations

from typing import Mapping, Sequence

TOLERANCE = 0.15  # relative: a point may sit this far below a narrower width or a shorter context before it is suspect


def interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear y(x) through sorted ``xs`` (linear extrapolation at both ends, never below 0)."""
    if len(xs) == 1:
        return max(0.0, float(ys[0]))
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def monotone(ys: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``ys`` in least squares (isotonic regression, pool adjacent violators).

    Example: [10, 11, 30, 13, 14] -> [10, 11, 19, 19, 19].
    """
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [m for m, n in blocks for _ in range(int(n))]


def suspect_points(table: Mapping[int, Sequence[float]], tolerance: float = TOLERANCE) -> set[tuple[int, int]]:
    """The (width, bucket index) points of ``table`` ({width: [ms per context bucket, buckets ascending]}) that break
    the shape of a step's cost by more than ``tolerance`` (relative): a wider step cheaper than a narrower one at the
    same context, or a longer context cheaper than a shorter one at the same width. Both points of a broken pair are
    returned (which of the two is off is not known: the harness times both again).

    Example: {1: [67, 38, 40]} -> {(1, 0), (1, 1)}; {1: [10], 2: [30], 3: [12]} -> {(2, 0), (3, 0)}.
    """
    bad: set[tuple[int, int]] = set()
    widths = sorted(table)
    for w in widths:
        row = table[w]
        for j in range(len(row) - 1):
            if row[j + 1] < row[j] * (1 - tolerance):
                bad |= {(w, j), (w, j + 1)}
    for a, b in zip(widths, widths[1:]):
        for j, (low, high) in enumerate(zip(table[a], table[b])):
            if high < low * (1 - tolerance):
                bad |= {(a, j), (b, j)}
    return bad
