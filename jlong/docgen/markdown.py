"""Markdown pieces of the generated pages: tables whose cells hold any text, inline code, anchors."""

from __future__ import annotations

GENERATED = ("!!! note \"Generated from the code\"\n    This page is generated from {source} when the site is "
             "built; edit the code, not the page.\n")


def cell(text) -> str:
    """Text for one table cell: on one line, its pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def code(text) -> str:
    """`text` as inline code (with a longer fence when it holds backticks)."""
    text = str(text)
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def anchored(text: str, anchor: str) -> str:
    """`text` as inline code carrying the HTML id `anchor`, so that `page.md#anchor` links to it."""
    return f'{code(text)}{{ id="{anchor}" }}'


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def paragraph(text: str | None) -> str:
    """A docstring as a paragraph: its lines joined."""
    return " ".join((text or "").split())
