"""Figures written as PNG files (matplotlib without a display)."""

from __future__ import annotations

import os
from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the file-only backend: runs need no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(figure, path: Path) -> Path:
    """`figure` as the PNG `path`, written under a temporary name and renamed
    when complete; the figure is closed."""
    tmp = path.with_name(path.name + ".tmp.png")
    figure.tight_layout()
    figure.savefig(tmp, dpi=100)
    pyplot().close(figure)
    os.replace(tmp, path)
    return path
