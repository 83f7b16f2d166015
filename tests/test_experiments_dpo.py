"""experiments/dpo_long_context.py rehearsed end to end with a few steps: two
seeds of fine-tuning, DPO and held-out scoring write the results file, led
by the preference for the faithful answer before and after DPO; DPO's
step 1 is log 2 with no reward (the reference is the fine-tuned model), and
the experiment's held-out scoring equals jlong's own pass over the pairs
(`jlong.objectives.dpo_reference.pair_logps`, what `jlong eval` runs)."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, load_experiment


@pytest.mark.slow  # an experiment rehearsed end to end: the long tier (about 1.5 minutes on 2 cores)
def test_dpo_long_context_rehearsed(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "results"
    result = subprocess.run(
        [sys.executable, str(REPO / "experiments" / "dpo_long_context.py"), "--seeds", "0", "1", "--sft-steps", "10",
         "--dpo-steps", "3", "--pairs", "24", "--trials", "4", "--runs", str(runs), "--out", str(out)],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    text = (out / "dpo-long-context.md").read_text()
    assert "--runs=DIR --out=DIR" in text and str(tmp_path) not in text
    assert text.splitlines()[2].startswith("The preference for the faithful answer on all 12 held-out pairs: ")
    table = [line for line in text.splitlines() if "prefers the faithful answer" in line]
    assert len(table) == 2 and all(line.count("[") == 4 for line in table), table  # three depths and all pairs
    results = json.loads((out / "dpo-long-context.json").read_text())
    assert sorted(results) == ["seed 0", "seed 1"]
    for seed in results.values():
        first = seed["dpo_first_step"]
        assert abs(first["loss"] - math.log(2)) < 1e-5 and first["rewards/margins"] == 0.0
        assert sorted(seed["held_out"]) == ["0.1", "0.5", "0.9", "all"]
        assert all(depth["before"]["rewards/margins"] == 0.0 for depth in seed["held_out"].values())
        whole = seed["held_out"]["all"]["before"]["prefers_chosen"]
        np.testing.assert_allclose(whole, np.mean([seed["held_out"][d]["before"]["prefers_chosen"]
                                                   for d in ("0.1", "0.5", "0.9")]))

    from jlong.eval.evaluate import load_params
    from jlong.objectives.dpo_reference import pair_logps

    scorer = load_experiment("dpo_long_context").HeldOut(runs / "held-out.npy")
    checkpoint = runs / "seed-0" / "dpo" / "ckpt"
    params, _ = load_params(scorer.program, str(checkpoint))
    np.testing.assert_allclose(scorer.logps(checkpoint), pair_logps(scorer.program, scorer.source, params),
                               rtol=1e-6)
