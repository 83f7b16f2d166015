"""experiments/grpo_long_context.py rehearsed end to end with a few steps
(`--rehearse`): one seed of fine-tuning, held-out generated answers, GRPO and
the answers again write the results file, its JSON and the reward plot; the
table's rows hold every held-out length and all prompts, and agree with the
JSON (accuracies in [0, 1], "all" the mean of the lengths, which hold as many
prompts each), and the reward has one value per GRPO step."""

import json
import statistics
import subprocess
import sys

import pytest
from helpers import REPO


@pytest.mark.slow  # an experiment rehearsed end to end: the long tier
def test_grpo_long_context_rehearsed(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "results"
    result = subprocess.run(
        [sys.executable, str(REPO / "experiments" / "grpo_long_context.py"), "--rehearse", "--seeds", "0",
         "--runs", str(runs), "--out", str(out)],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    text = (out / "grpo-long-context.md").read_text()
    assert "--rehearse --runs=DIR --out=DIR" in text and str(tmp_path) not in text
    assert text.splitlines()[2].startswith("Held-out generated-answer accuracy (greedy, exact match), before GRPO")
    assert (out / "grpo-long-context.png").read_bytes().startswith(b"\x89PNG")

    results = json.loads((out / "grpo-long-context.json").read_text())
    assert sorted(results) == ["provenance", "seed 0", "settings"]
    settings, seed = results["settings"], results["seed 0"]
    assert results["provenance"]["command"].startswith("python experiments/grpo_long_context.py --seeds 0")
    lengths = [str(n) for n in settings["held_out_tokens"]]
    assert len(seed["reward"]) == len(seed["grpo_records"]) == settings["grpo_steps"] == 3
    assert all(0 <= r <= 1 for r in seed["reward"])
    rows = {}
    for when in ("before", "after"):
        accuracy = seed["held_out"][when]
        assert sorted(accuracy) == sorted([*lengths, "all"])
        assert all(0 <= value <= 1 for value in accuracy.values())
        # settings["trials"] prompts at each length: all of them is the mean of the lengths
        assert accuracy["all"] == pytest.approx(statistics.mean(accuracy[n] for n in lengths))
        assert all(accuracy[n] * settings["trials"] == pytest.approx(round(accuracy[n] * settings["trials"]))
                   for n in lengths)
        rows[when] = [f"{accuracy[n]:.2f}" for n in [*lengths, "all"]]
    table = {line.split(" | ")[0]: line.strip("| ").split(" | ")[1:] for line in text.splitlines()
             if line.startswith(("| before GRPO", "| after GRPO", "| change"))}
    assert table["| before GRPO (the fine-tuned model)"] == rows["before"]
    assert table["| after GRPO"] == rows["after"]
    assert len(table["| change (each seed's after - before)"]) == len(lengths) + 1
