"""The README as a front door: short, and every tiny preset in it with a line that runs it as designed."""

import re
import shlex

import pytest
from helpers import REPO

from jlong.config import load_config, preset_names

pytestmark = pytest.mark.fast
README = (REPO / "README.md").read_text()


def test_the_readme_stays_a_front_door():
    assert len(README) < 15_000, f"README.md is {len(README):,} characters: move detail into docs/"


def test_every_tiny_preset_has_a_line_that_loads_it_whole():
    lines = {}
    for command in re.findall(r"`(\.venv/bin/jlong train configs/tiny\.yaml [^`]+)`", README):
        overrides = shlex.split(command)[3:]
        preset = dict(o.split("=", 1) for o in overrides)["model.preset"]
        lines[preset] = overrides
    tiny = [name for name in preset_names() if name.startswith("tiny-")]
    assert sorted(lines) == sorted(tiny), "each tiny preset needs one line in README.md's table"
    for preset, overrides in lines.items():
        config = load_config(REPO / "configs" / "tiny.yaml", overrides)
        whole = load_config(None, [f"model.preset={preset}"]).model
        assert config.model == whole, f"{preset}: configs/tiny.yaml changes the preset's model"
        assert config.run_dir == f"runs/{preset}" and config.checkpoint.dir == f"runs/{preset}/checkpoints"
