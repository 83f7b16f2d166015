"""The metrics reference, from their declaration (`jlong.training.metric_names`): each key of a metrics.jsonl
record, the per-source names, the entries of the list-valued ones, and the names TensorBoard and W&B show."""

from __future__ import annotations

from jlong.docgen.markdown import GENERATED, anchored, code, table
from jlong.training import metric_names


def _anchor(name: str) -> str:
    return "metric-" + name.replace("/", "-").replace("<", "").replace(">", "").replace(".", "-")


def metrics_page() -> str:
    metrics = metric_names.METRICS
    out = [
        "# Metrics\n",
        GENERATED.format(source="`jlong.training.metric_names`"),
        "Each step writes one JSON object to `run_dir/metrics.jsonl` (always written, whatever `train.log_to` "
        "says: resuming and `loss.png` read it), and to TensorBoard or W&B when "
        "[`train.log_to`](config.md#train.log_to) names them. A run without `run_dir` writes none; `jlong.train` "
        "returns the same records.\n",
        "## Every step { #every-step }\n",
        table(["key", "meaning"], [[anchored(m.name, m.name), m.meaning] for m in metrics if m.every_step]),
        "## Some runs and steps { #some-steps }\n",
        table(["key", "when", "meaning"], [[anchored(m.name, m.name), m.when, m.meaning]
                                           for m in metrics if not m.every_step]),
        "## Per reward function { #per-reward-function }\n",
        "GRPO logs each function of [`rl.rewards`](config.md#rl.rewards) by its name (a built-in's, or the "
        "function's after the colon):\n",
        table(["name", "meaning"], [[anchored(p.pattern, _anchor(p.pattern)), p.meaning]
                                    for p in metric_names.REWARD_FUNCTIONS]),
        "## Per-source names { #per-source }\n",
        "Where a key's value is a mapping, its keys are the sources' names (`name` of a `data.mix` or `eval.mix` "
        "entry; by default its path's stem):\n",
        table(["name", "meaning"], [[anchored(p.pattern, _anchor(p.pattern)), p.meaning]
                                    for p in metric_names.PER_SOURCE]),
        "## List entries { #entries }\n",
        "Where a key's value is a list, each entry holds:\n",
        table(["key", "entry field", "meaning"], [[code(key), anchored(f"{key}[].{field}", _anchor(f"{key}-{field}")),
                                                   meaning] for key, fields in metric_names.ENTRIES.items()
                                                  for field, meaning in fields.items()]),
        "## TensorBoard and W&B { #logged }\n",
        "The scalars each record gives TensorBoard (`run_dir/tensorboard`) and Weights & Biases, at the record's "
        "step:\n",
        table(["name", "meaning"], [[anchored(p.pattern, _anchor("logged-" + p.pattern)), p.meaning]
                                    for p in metric_names.LOGGED]),
    ]
    return "\n".join(out)
