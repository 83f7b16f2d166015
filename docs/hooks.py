"""mkdocs hooks (mkdocs.yml's `hooks:`): the pages the site builds that are not files of docs/.

- reference/config.md, cli.md, families.md and metrics.md, generated from the code by `jlong.docgen` at
  every build (nothing generated is committed, so they cannot drift from it);
- experiments/results/**, every results page and the images and data files beside them, as results/<path>:
  a page of docs/ links to one as `results/<file>.md`, and a results page's own relative links (its images,
  its neighbours) work unchanged. They are pages outside the nav, linked from docs/results.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "experiments" / "results"
RESULTS_URI = "results"


def on_startup(command, dirty) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the generator only reads jlong; no accelerator is touched
    if str(REPO) not in sys.path:  # the jlong of this checkout, installed or not
        sys.path.insert(0, str(REPO))


def on_files(files: Files, config) -> Files:
    from jlong.docgen import PAGES

    for uri, page in PAGES.items():
        files.append(File.generated(config, uri, content=page()))
    for path in sorted(RESULTS.rglob("*")):
        if path.is_file():
            uri = f"{RESULTS_URI}/{path.relative_to(RESULTS).as_posix()}"
            inclusion = InclusionLevel.NOT_IN_NAV if path.suffix == ".md" else InclusionLevel.UNDEFINED
            files.append(File.generated(config, uri, abs_src_path=str(path), inclusion=inclusion))
    return files
