"""CI cannot hide a skip: `.ci/run` stops when an install fails (the gpu-plan extra too, unless its documented
setting allows it), and runs the README's test command, `-rs` included. The script runs for real here, in a
copy of `.ci/`, with a stand-in `python3` / `python` that records each call and fails the pip installs it is
told to."""

import os
import re
import shlex
import shutil
import subprocess

import pytest
from helpers import REPO

pytestmark = pytest.mark.fast

# `-m venv DIR` makes DIR an environment whose `python` is this script; `-m pip install ...` fails where its
# arguments contain $FAIL_INSTALL; anything else succeeds. Every call is appended to $CALLS.
STAND_IN = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
if [ "$1 $2" = "-m venv" ]; then
    mkdir -p "$3/bin" && cp "$0" "$3/bin/python"
    printf 'PATH="%s:$PATH"\\ndeactivate() { :; }\\n' "$(cd "$3/bin" && pwd)" > "$3/bin/activate"
    exit 0
fi
if [ "$1 $2 $3" = "-m pip install" ] && [[ "$*" == *"$FAIL_INSTALL"* ]]; then
    exit 1
fi
exit 0
"""


def run_ci(tmp_path, fail_install: str, **settings) -> tuple[subprocess.CompletedProcess, list[str]]:
    """.ci/run in a copy of the repository's .ci/, with pip failing on `fail_install`; (result, calls)."""
    shutil.copytree(REPO / ".ci", tmp_path / "repo" / ".ci")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(STAND_IN)
    (bin_dir / "python3").chmod(0o755)
    calls = tmp_path / "calls"
    env = {key: value for key, value in os.environ.items() if not key.startswith("JLONG_CI_")}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", CALLS=str(calls), FAIL_INSTALL=fail_install, **settings)
    result = subprocess.run([str(tmp_path / "repo" / ".ci" / "run")], env=env, capture_output=True, text=True,
                            timeout=60)
    return result, calls.read_text().splitlines() if calls.exists() else []


def pytest_calls(calls: list[str]) -> list[str]:
    return [call for call in calls if call.startswith("-m pytest")]


def test_ci_fails_when_the_gpu_plan_extra_cannot_install(tmp_path):
    result, calls = run_ci(tmp_path, '.[gpu-plan]')
    assert result.returncode != 0
    assert "CI FAILED: the gpu-plan extra did not install" in result.stderr
    assert "JLONG_CI_ALLOW_NO_GPU_PLAN=1" in result.stderr, "the failure names the setting that allows it"
    assert not pytest_calls(calls), "no test ran after the failed install"


def test_the_documented_setting_lets_ci_go_on_without_the_gpu_plan_extra(tmp_path):
    result, calls = run_ci(tmp_path, '.[gpu-plan]', JLONG_CI_ALLOW_NO_GPU_PLAN="1")
    assert result.returncode == 0, result.stderr
    assert "WARNING: the gpu-plan extra did not install" in result.stderr
    suite, fast_tier = pytest_calls(calls)
    assert "-rs" in suite.split() and "-rs" in fast_tier.split(), "both pytest runs list their skips"


@pytest.mark.parametrize("failing", ["torch==2.13.0", '.[test]'])
def test_ci_fails_when_a_tests_dependency_cannot_install_whatever_the_setting(tmp_path, failing):
    result, calls = run_ci(tmp_path, failing, JLONG_CI_ALLOW_NO_GPU_PLAN="1")
    assert result.returncode != 0 and "CI FAILED" in result.stderr
    assert not pytest_calls(calls)


def test_the_readme_test_command_is_what_ci_runs():
    readme = (REPO / "README.md").read_text()
    command = next(line for line in readme.splitlines() if "-m pytest" in line and "not slow" in line)
    readme_args = shlex.split(command[command.index("-m pytest"):])
    ci = (REPO / ".ci" / "run").read_text()
    ci_line = next(line for line in ci.splitlines() if re.match(r"\s*python -m pytest", line))
    assert shlex.split(ci_line.strip())[1:] == readme_args
    assert "-rs" in readme_args
