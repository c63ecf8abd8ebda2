"""bisect's two pictures: |logdiff| by response token per sequence, and the first divergence by capture
point and layer. Both are log10 colour maps where white means bitwise equal."""

from __future__ import annotations

import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from logdiff.report import write_atomic  # noqa: E402

_CMAP = plt.get_cmap("viridis").with_extremes(bad="white")
_ABSENT = "#d9d9d9"


def _log10(values: np.ndarray) -> np.ndarray:
    """log10 |d|; NaN (drawn white) where d is exactly 0, so 'equal' never hides behind a tiny colour."""
    with np.errstate(divide="ignore"):
        out = np.log10(values)
    out[values == 0] = np.nan
    return out


def _save(fig, path: str | os.PathLike) -> None:
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))
    plt.close(fig)


def plot_logdiff(path, logdiff: list[list[float]], first: tuple[int, int] | None, title: str) -> None:
    """Rows: sequences; columns: response tokens; colour: log10 |logp_rollout - logp_trainer|."""
    width = max(len(row) for row in logdiff)
    values = np.full((len(logdiff), width), np.nan)
    present = np.zeros_like(values, dtype=bool)
    for s, row in enumerate(logdiff):
        values[s, : len(row)] = row
        present[s, : len(row)] = True
    image = _log10(np.where(present, values, 0.0))
    fig, ax = plt.subplots(figsize=(max(8.0, 0.22 * width + 2), max(3.0, 0.4 * len(logdiff) + 1.6)))
    ax.imshow(np.where(present, 0.0, np.nan), cmap=matplotlib.colors.ListedColormap([_ABSENT]), aspect="auto")
    shown = ax.imshow(image, cmap=_CMAP, aspect="auto", interpolation="nearest")
    if np.isfinite(image).any():
        fig.colorbar(shown, ax=ax, label="log10 |logdiff|")
    if first is not None:
        seq, pos = first
        ax.add_patch(Rectangle((pos - 0.5, seq - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
    equal = int(np.sum(present & (values == 0)))
    ax.set_title(f"{title}\nwhite: bitwise equal ({equal} of {int(present.sum())} tokens); red: first divergence", fontsize=9)
    ax.set_xlabel("response token")
    ax.set_ylabel("sequence")
    ax.set_yticks(range(len(logdiff)))
    _save(fig, path)


def plot_first_divergence(path, points: list[str], values: list[list[float | None]], first: tuple[str, int] | None,
                          title: str) -> None:
    """Rows: capture points of a layer, in forward order; columns: layers; colour: log10 max |diff| at the
    divergent token; "=" bitwise equal; grey: the stack does not capture that point there."""
    grid = np.array([[math.nan if v is None else v for v in row] for row in values], dtype=float)
    absent = np.array([[v is None for v in row] for row in values])
    layers = grid.shape[1]
    fig, ax = plt.subplots(figsize=(max(4.5, 0.5 * layers + 3.5), 0.3 * len(points) + 1.6))
    ax.imshow(np.where(absent, 0.0, np.nan), cmap=matplotlib.colors.ListedColormap([_ABSENT]), aspect="auto")
    image = _log10(np.where(absent, 0.0, grid))
    shown = ax.imshow(image, cmap=_CMAP, aspect="auto", interpolation="nearest")
    if np.isfinite(image).any():
        fig.colorbar(shown, ax=ax, label="log10 max |diff| at the row (=: bitwise equal)")
    for r, c in zip(*np.nonzero(grid == 0)):
        ax.text(c, r, "=", ha="center", va="center", fontsize=8, color="#808080")
    ax.set_xticks(np.arange(-0.5, layers), minor=True)
    ax.set_yticks(np.arange(-0.5, len(points)), minor=True)
    ax.grid(which="minor", color="#bfbfbf", linewidth=0.5)
    ax.tick_params(which="minor", length=0)
    if first is not None and first[0] in points:
        ax.add_patch(Rectangle((first[1] - 0.5, points.index(first[0]) - 0.5), 1, 1, fill=False, edgecolor="red",
                               linewidth=2))
    ax.set_yticks(range(len(points)), points, fontsize=8)
    ax.set_xticks(range(layers))
    ax.set_xlabel("layer")
    ax.set_title(title, fontsize=9)
    _save(fig, path)
