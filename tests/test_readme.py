"""The README as a front door: short, every tiny preset in it with a line that runs it as designed, and every
measured figure of its results table (and docs/results.md's) in a results file the row links."""

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


# "Results at a glance": every figure of a row whose kind says measured is in a results file the row links.
RESULTS = REPO / "experiments" / "results"
NUMBER = re.compile(r"(?<![\w.,])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\dA-wyz])|(?<![\w.,])\d+(?:\.\d+)?(?![\dA-wyz])")
LINK = re.compile(r"\]\(([^)#\s]+)")


def glance_rows(text: str, page) -> list[dict]:
    """The rows of a page's results table (headed `| what | figure | kind |`): its cells and the results files
    they link (`page`'s links resolved; docs/results.md's `results/...` is experiments/results/...)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| what | figure | kind |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        files = []
        for target in LINK.findall(line):
            path = (page.parent / target).resolve()
            if page.parent.name == "docs" and target.startswith("results/"):
                path = RESULTS / target.removeprefix("results/")
            if path.is_file() and RESULTS in path.parents:
                files.append(path)
        rows.append({"what": cells[0], "figure": cells[1], "kind": cells[2], "files": files})
    return rows


def plain(text: str) -> str:
    """Thousands separators dropped: 2,929,688 and 2929688 read alike."""
    return re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)


def missing_figures(row: dict) -> list[str]:
    """The numbers of a measured row's figure that none of its linked results files holds (all of them when it
    links none)."""
    texts = [plain(path.read_text(encoding="utf-8")) for path in row["files"]]
    return [number for number in NUMBER.findall(row["figure"])
            if not any(re.search(rf"(?<![\d.]){re.escape(plain(number))}(?!\d|[eE][-+]?\d)", text) for text in texts)]


@pytest.mark.parametrize("page", ["README.md", "docs/results.md"])
def test_every_measured_figure_at_a_glance_is_in_a_results_file_the_row_links(page):
    path = REPO / page
    measured = [row for row in glance_rows(path.read_text(), path) if "measured" in row["kind"]]
    assert len(measured) >= 5, f"{page}: the results table was not found"
    for row in measured:
        assert row["files"], f"{page}: the measured row {row['what']!r} links no file under experiments/results/"
        assert not missing_figures(row), (f"{page}: {row['what']!r}: {missing_figures(row)} in no linked results "
                                          f"file ({', '.join(p.name for p in row['files'])})")


def test_a_figure_edited_to_one_its_results_file_lacks_is_caught():
    readme = REPO / "README.md"
    kernel_race = next(row for row in glance_rows(README, readme) if "kernel-race" in str(row["files"]))
    assert not missing_figures(kernel_race)
    ratio = next(number for number in NUMBER.findall(kernel_race["figure"]) if "." in number)  # 0.46 of FLA's
    edited = README.replace(kernel_race["figure"], kernel_race["figure"].replace(ratio, ratio + "7", 1))
    row = next(row for row in glance_rows(edited, readme) if "kernel-race" in str(row["files"]))
    assert missing_figures(row) == [ratio + "7"]
