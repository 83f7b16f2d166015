"""The documentation's reference pages, generated from the code so that they cannot drift from it: the
configuration from the schema (`jlong.config.schema`: each field's type, default, allowed values and
description), the command line from its parser (`jlong.cli.build_parser`), the model families from their
registry and the presets from configs/models, the metrics from their declaration
(`jlong.training.metric_names`).

Each page is a function returning Markdown; `PAGES` names them by their path in the site. docs/hooks.py adds
them to the mkdocs build, so nothing generated is committed. This package reads jlong; nothing in jlong imports
it.
"""

from __future__ import annotations

from collections.abc import Callable

from jlong.docgen.cli import cli_page
from jlong.docgen.config import config_page
from jlong.docgen.families import families_page
from jlong.docgen.metrics import metrics_page

PAGES: dict[str, Callable[[], str]] = {
    "reference/config.md": config_page,
    "reference/cli.md": cli_page,
    "reference/families.md": families_page,
    "reference/metrics.md": metrics_page,
}

__all__ = ["PAGES", "cli_page", "config_page", "families_page", "metrics_page"]
