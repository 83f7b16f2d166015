"""Every file under experiments/results says where it came from, and none names a path of the machine that
wrote it: each Markdown result names a commit and a jax version (recorded by the script, or reconstructed
from git and labelled so), and no text file holds an absolute path such as /home/... or /tmp/...."""

import re

import pytest
from helpers import REPO

RESULTS = REPO / "experiments" / "results"
BINARY = {".png", ".jpg", ".jpeg", ".gif", ".pdf", ".svg", ".npy", ".npz", ".pkl", ".gz", ".zip"}

HASH = r"\b(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"  # a git hash, short or full
# "commit" with a hash at most 80 characters after it (or before it: "fe417e9 ... commit")
COMMIT = re.compile(rf"\bcommits?\b[^\n]{{0,80}}?{HASH}|{HASH}[^\n]{{0,40}}?\bcommit\b", re.IGNORECASE)
# "jax 0.10.2", "jax and jaxlib 0.11.2", "jax==0.10.2", "jax[cuda12-local]==0.10.2"
JAX = re.compile(r"\bjax(?:lib)?\b[^\d\n]{0,30}\d+\.\d+\.\d+")
# The start of an absolute path of a machine: POSIX home, scratch and temporary directories, or a Windows
# drive. Not inside a URL or a longer path (https://host/home/..., experiments/results/tmp/...): the character
# before it is none of a word, '.', ':', '/' or '-'.
MACHINE_PATH = re.compile(
    r"(?<![\w.:/\-])/(?:work|home|tmp|root|Users|mnt|scratch|private|var/folders|data|opt|srv)/"
    r"|(?<![\w\\])[A-Z]:\\{1,2}(?=[\w .-]+\\)"
)


def text_files() -> list:
    return sorted(p for p in RESULTS.rglob("*") if p.is_file() and p.suffix.lower() not in BINARY)


def markdown_files() -> list:
    return sorted(RESULTS.rglob("*.md"))


@pytest.mark.fast
def test_the_results_are_there():
    assert markdown_files(), f"no .md under {RESULTS.relative_to(REPO)}"


@pytest.mark.fast
@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_markdown_result_names_its_commit_and_jax_version(path):
    text = path.read_text(encoding="utf-8")
    name = path.relative_to(REPO)
    assert COMMIT.search(text), f"{name} names no commit (a 7-40 hex-digit hash beside the word 'commit')"
    assert JAX.search(text), f"{name} names no jax version (e.g. 'jax 0.10.2')"


@pytest.mark.fast
@pytest.mark.parametrize("path", text_files(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_no_result_holds_an_absolute_path_of_a_machine(path):
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        pytest.skip(f"{path.name} is not text")
    found = [(text.count("\n", 0, m.start()) + 1, text[max(0, m.start() - 30):m.end() + 30].replace("\n", " "))
             for m in MACHINE_PATH.finditer(text)]
    assert not found, f"{path.relative_to(REPO)} holds absolute machine paths (line, context): {found[:5]}"


@pytest.mark.fast
@pytest.mark.parametrize("text, found", [
    ("Produced by `x` at commit 1409df6+changes on 2026-11-27 with jax 0.10.2", (True, True)),
    ("the code of commit e261d90, jax 0.10.2", (True, True)),
    ("fe417e9 (its working tree) at commit time; jax and jaxlib 0.11.2", (True, True)),
    ("Produced by `python experiments/maxlen.py` with jax 0.10.2 on x86_64", (False, True)),
    ("at commit unknown on 2026-11-27 with jax", (False, False)),
])
def test_the_commit_and_jax_patterns(text, found):
    assert (bool(COMMIT.search(text)), bool(JAX.search(text))) == found


@pytest.mark.fast
@pytest.mark.parametrize("text, machine", [
    ("--out /tmp/jlong-gpu-truth-x/out", True),
    ('"run_dir": "/home/user/runs/a"', True),
    ("written to /work/main/experiments/results", True),
    ("--out=/root/x", True),
    ('"C:\\\\Users\\\\me\\\\runs"', True),
    ("--out DIR, see https://example.com/home/page and experiments/results/tmp/x", False),
    ("experiments/results/retrieval-extension/results.md", False),
    ('"error": "E:\\n expected"', False),
])
def test_the_machine_path_pattern(text, machine):
    assert bool(MACHINE_PATH.search(text)) == machine
