"""The README's tiny mixture-of-experts lines train with balanced experts: each line of README.md's table whose
preset is a mixture, run as written (its steps and learning rate, configs/tiny.yaml's other settings) on the README's token file (the
standard library's Python files, 4,000,000 bytes), says no routing warning and ends with the busiest expert of
every layer within 2x the mean (measured here: tiny-qwen3-moe 1.27 after 60 steps, tiny-gpt-oss 1.34 after 60,
tiny-qwen3.5-moe 1.51 after 30; before the load-balancing loss was taken per layer, with 0.1 as the presets'
coefficient and 1e-3 as the lines' learning rate (train.lr=1e-3; configs/tiny.yaml's 3e-3), 4.0, 3.0 and 3.8: collapsed)."""

import re
import shlex
import sysconfig

import pytest
from helpers import REPO

import jlong
from jlong.config import load_config
from jlong.data.prepare import prepare

TINY = REPO / "configs" / "tiny.yaml"
README_LINES = [shlex.split(command)[3:] for command in
                re.findall(r"`(\.venv/bin/jlong train configs/tiny\.yaml [^`]+)`", (REPO / "README.md").read_text())]
MIXTURE_LINES = {dict(o.split("=", 1) for o in line)["model.preset"]: line for line in README_LINES
                 if load_config(TINY, line).model.num_experts}


@pytest.fixture(scope="module")
def stdlib_tokens(tmp_path_factory):
    """The README's token file: `jlong prepare runs/stdlib.npy STDLIB --glob '*.py' --max-tokens 4000000`."""
    path = tmp_path_factory.mktemp("data") / "stdlib.npy"
    prepare(str(path), [sysconfig.get_path("stdlib")], pattern="*.py", max_tokens=4_000_000)
    return path


@pytest.mark.fast
def test_the_readme_has_its_three_mixture_lines():
    assert {"tiny-gpt-oss", "tiny-qwen3-moe", "tiny-qwen3.5-moe"} <= set(MIXTURE_LINES)


@pytest.mark.slow  # a minute or two each: the long tier
@pytest.mark.parametrize("preset", sorted(MIXTURE_LINES))
def test_a_readme_mixture_line_trains_with_balanced_experts(preset, stdlib_tokens, tmp_path, capsys):
    line = [o for o in MIXTURE_LINES[preset] if not o.startswith(("run_dir=", "checkpoint.dir="))]
    records = jlong.train(TINY, [*line, f"data.path={stdlib_tokens}", f"run_dir={tmp_path / 'run'}",
                                 f"checkpoint.dir={tmp_path / 'checkpoints'}"])
    said = capsys.readouterr().out
    assert len(records) == load_config(TINY, line).train.steps
    assert "routing has collapsed" not in said, said
    assert records[-1]["expert_load_max_over_mean"] <= 2.0, [r["expert_load_max_over_mean"] for r in records]
