"""The documentation site: its reference pages, generated from the code (`jlong.docgen`), name every config
field (all sections, list entries included), every `jlong` subcommand and argument, every family and preset
and every metric; the metric declaration they are written from (`jlong.training.metric_names`) matches what
real steps write; and the whole site builds with mkdocs --strict (warnings as errors: broken links and
anchors), the built reference pages naming everything too.

What the pages must name is found here from the code on its own (the schema's models, the parser, the
presets directory), not from the generator; each check names what is missing, and is itself checked on a page
with one item taken out."""

import argparse
import html
import inspect
import json
import os
import subprocess
import sys
import typing

import numpy as np
import pytest
from helpers import MESH, REPO, SMALL_MODEL, run_config

from jlong.cli import build_parser
from jlong.config import load_config, schema
from jlong.config.registry import FAMILIES
from jlong.docgen import PAGES, cli_page, config_page, families_page, metrics_page
from jlong.docgen.config import ENTRY_MODELS
from jlong.training import metric_names
from jlong.training.metric_names import LOGGED, METRICS, PER_SOURCE, REWARD_FUNCTIONS, undeclared

# ---------------------------------------------------------------- what the pages must name, from the code


def _models_in(annotation) -> list[type]:
    """The schema models an annotation holds: itself, a union's members, a tuple's items."""
    if inspect.isclass(annotation) and issubclass(annotation, schema.BaseModel):
        return [annotation]
    return [model for part in typing.get_args(annotation) for model in _models_in(part)]


def config_fields(model=schema.Config, prefix="", seen: set | None = None) -> dict[str, str]:
    """Every setting's path -> its description: sections' fields (`train.seq_len`), list entries'
    (`stages[].until_step`, `data.mix[].weight`); the models reached are added to `seen`."""
    fields = {}
    if seen is not None:
        seen.add(model)
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        fields[path] = field.description
        for inner in _models_in(field.annotation):
            listed = typing.get_origin(field.annotation) is tuple
            fields.update(config_fields(inner, f"{path}[]." if listed else f"{path}.", seen))
        if path in ENTRY_MODELS:
            fields.update(config_fields(ENTRY_MODELS[path], f"{path}[].", seen))
    return fields


def schema_models() -> set[type]:
    return {cls for cls in vars(schema).values()
            if inspect.isclass(cls) and issubclass(cls, schema._Section) and cls is not schema._Section}


def cli_arguments() -> dict[str, list[str]]:
    """Each subcommand -> every way its arguments are written (option strings, positionals' names)."""
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: [written for action in sub._actions if not isinstance(action, argparse._HelpAction)
                   for written in (action.option_strings or [action.metavar or action.dest])]
            for name, sub in commands.choices.items()}


def preset_names() -> list[str]:
    return sorted(path.stem for path in (REPO / "configs" / "models").glob("*.yaml"))


def metric_names_to_show() -> list[str]:
    entries = [f"{key}[].{field}" for key, fields in metric_names.ENTRIES.items() for field in fields]
    return [m.name for m in METRICS] + [p.pattern for p in (*REWARD_FUNCTIONS, *PER_SOURCE, *LOGGED)] + entries


# ---------------------------------------------------------------- the checks


def entry(name: str) -> str:
    """How a page's table names an item of its own: its inline code, carrying an anchor (`{ id=... }`)."""
    return f"`{name}`{{ id="


def absent(text: str, names, form=entry) -> list[str]:
    """The names that `text` lacks, each looked for as `form(name)` (an entry of a page's tables by default)."""
    return [name for name in names if form(name) not in text]


def config_absent(page: str, fields) -> list[str]:
    """The config fields a configuration page lacks: a section's heading, every other field's entry."""
    def shown(path):
        return entry(path) in page if "." in path else f"## {path} {{ #{path} }}" in page

    return [path for path in fields if not shown(path)]


def cli_absent(page: str, arguments: dict[str, list[str]], form=entry,
               heading: tuple[str, str] = ("\n## jlong ", " ")) -> list[str]:
    """Subcommands without their section, and arguments missing from their subcommand's section (the text from
    `heading[0]` + the command's name + `heading[1]` to the next heading)."""
    start, end = heading
    sections = {part.split(end, 1)[0]: part for part in page.split(start)[1:]}
    missing = []
    for command, written in arguments.items():
        if command not in sections:
            missing.append(command)
            continue
        missing += [f"{command} {name}" for name in absent(sections[command], written, form)]
    return missing


def _without_line(page: str, needle: str) -> str:
    lines = page.splitlines()
    kept = [line for line in lines if needle not in line]
    assert len(kept) == len(lines) - 1, f"{needle!r} is on {len(lines) - len(kept)} lines"
    return "\n".join(kept)


@pytest.fixture(scope="module")
def pages():
    return {"config": config_page(), "cli": cli_page(), "families": families_page(), "metrics": metrics_page()}


@pytest.mark.fast
def test_every_schema_field_has_a_description_and_every_model_is_reached():
    reached = set()
    fields = config_fields(seen=reached)
    assert len(fields) > 120 and "data.mix[].weight" in fields and "stages[].until_step" in fields
    assert [path for path, description in fields.items() if not description] == []
    assert schema_models() - reached == set(), "a model of the schema that no setting reaches: is it a list's " \
        "entries? (jlong.docgen.config.ENTRY_MODELS)"


@pytest.mark.fast
def test_the_configuration_reference_names_every_field_with_its_description(pages):
    page = pages["config"]
    fields = config_fields()
    assert config_absent(page, fields) == []
    assert absent(page, [" ".join(d.split()) for d in fields.values()], form=str) == []
    assert "| > 0 |" in page and "`float32`, `bfloat16`" in page  # bounds and choices
    assert "1 to 9" in page and "`ulysses`" in page  # a schema validator's bound, a registry's names


@pytest.mark.fast
def test_the_command_line_reference_names_every_subcommand_and_argument(pages):
    arguments = cli_arguments()
    assert {"train", "eval", "plan", "maxlen", "convert", "verify", "prepare"} <= set(arguments)
    assert "--dry-run" in arguments["train"] and "inputs" in arguments["prepare"]
    assert cli_absent(pages["cli"], arguments) == []


@pytest.mark.fast
def test_the_families_reference_names_every_family_and_preset(pages):
    page = pages["families"]
    assert len(preset_names()) > 20
    assert absent(page, preset_names()) == []
    assert absent(page, FAMILIES.names()) == []
    assert "| `qwen3-30b-a3b`{ id=\"preset-qwen3-30b-a3b\" } | [`qwen3_moe`](#family-qwen3_moe) | 48 | 2048 | " \
           "32 / 4 | 128 (8 per token) |" in page


@pytest.mark.fast
def test_the_metrics_reference_names_every_metric_and_pattern(pages):
    names = metric_names_to_show()
    assert {"loss", "tokens_by_source.<source>", "eval/loss_by_source/<source>"} <= set(names)
    assert absent(pages["metrics"], names) == []


@pytest.mark.fast
def test_each_check_names_what_a_page_lacks(pages):
    config = _without_line(pages["config"], "`train.seq_len`{")
    assert config_absent(config, config_fields()) == ["train.seq_len"]
    mixed = _without_line(pages["config"], "`data.mix[].weight`{")
    assert config_absent(mixed, config_fields()) == ["data.mix[].weight"]
    assert config_absent(pages["config"].replace("## stages {", "## stages{"), config_fields()) == ["stages"]
    cli = _without_line(pages["cli"], "`--dry-run`{")
    assert cli_absent(cli, cli_arguments()) == ["train --dry-run"]
    assert cli_absent(pages["cli"].replace("## jlong verify", "## verify"), cli_arguments()) == ["verify"]
    families = _without_line(pages["families"], "`tiny-qwen3-moe`{")
    assert absent(families, preset_names()) == ["tiny-qwen3-moe"]
    metrics = _without_line(pages["metrics"], "`eval/loss_by_source/<source>`{")
    assert absent(metrics, metric_names_to_show()) == ["eval/loss_by_source/<source>"]


# ---------------------------------------------------------------- the metric declaration against real steps


@pytest.mark.fast
def test_the_undeclared_check_names_what_is_not_declared():
    assert undeclared({"loss": 1.0, "tokens_by_source": {"web": 8}, "eval_passkey": [{"length": 8}]}) == []
    assert undeclared({"loss": 1.0, "losss": 2.0}) == ["losss"]
    assert undeclared({"eval_loss_by_position": [{"start": 0, "bucket": 1}]}) == ["eval_loss_by_position[].bucket"]
    assert metric_names.NamePattern("train/<metric>", "").matches("train/rewards/chosen")
    assert not metric_names.NamePattern("eval/loss_by_source/<source>", "").matches("eval/loss_by_source")


def test_real_steps_write_declared_names_and_every_metric_of_every_step(tmp_path, monkeypatch):
    """Two steps of the small run test_train_loop trains (the same compiled step), on a mixture of two corpora,
    evaluated on two held-out ones at each step, in two stages, with a peak FLOP rate so that MFU is logged:
    every key and per-source name its records hold is declared, every metric declared for every step is there,
    and the names TensorBoard and W&B get match the declared patterns."""
    from jlong.training import loop
    from jlong.training.metric_sinks import scalars

    monkeypatch.setattr(loop, "peak_flops_per_device", lambda: 1e12)
    rng = np.random.default_rng(0)
    for name in ("web", "code", "held_a", "held_b"):
        np.save(tmp_path / f"{name}.npy", rng.integers(1, 128, 4096).astype(np.uint16))
    mix = json.dumps([{"path": str(tmp_path / "web.npy"), "weight": 3}, {"path": str(tmp_path / "code.npy")}])
    held = json.dumps([{"path": str(tmp_path / "held_a.npy")}, {"path": str(tmp_path / "held_b.npy")}])
    stages = json.dumps([{"until_step": 1, "set": {}}, {"until_step": 6, "set": {}}])
    config = run_config(tmp_path, "checkpoint.dir=null", "data.source=tokens", f"data.mix={mix}", f"eval.mix={held}",
                        "train.eval_every=1", "eval.sequences=2", "eval.passkey_trials=0", f"stages={stages}")
    loop.train(config, until_step=2)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    assert [name for record in records for name in undeclared(record)] == []
    every_step = {m.name for m in METRICS if m.every_step}
    assert [sorted(every_step - set(record)) for record in records] == [[], []]
    assert {"mfu", "stage", "tokens_by_source", "eval_loss", "eval_loss_by_position",
            "eval_loss_by_source"} <= set().union(*records)
    assert set(records[0]["tokens_by_source"]) == {"web", "code"}
    logged = {name for record in records for name in scalars(record)}
    assert [name for name in logged if not any(p.matches(name) for p in LOGGED)] == []


@pytest.mark.fast
@pytest.mark.parametrize("objective", ["lm", "dpo", "grpo"])
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_the_metrics_a_step_program_returns_are_declared(objective, model):
    """The train step's own metrics (the loss, the gradient's norm, the model's: a mixture of experts' routing,
    DPO's rewards, GRPO's clip ratios, entropy and KL), read from the step traced for abstract inputs (nothing
    compiles)."""
    import jax

    from jlong.parallel.placement import make_mesh
    from jlong.program.train_program import TrainProgram

    settings = {"dense": [], "moe": ["model.preset=tiny-qwen3-moe", "model.moe_intermediate_size=32",
                                     "model.num_hidden_layers=1"]}[model]
    if objective == "dpo":
        settings += ["train.objective=dpo", "data.source=tokens", "data.path=pairs.npy", "attention.max_documents=9"]
    if objective == "grpo":
        settings += ["train.objective=grpo", "rl.prompts=prompts.jsonl", "rl.rewards=[exact_answer]", "rl.beta=0.1",
                     "rl.max_new_tokens=16"]
    config = load_config(None, [*SMALL_MODEL, *MESH, *settings])
    program = TrainProgram(config, make_mesh(config.mesh))
    _, _, metrics = jax.eval_shape(program.step, program.abstract_params, program.abstract_opt_state,
                                   program.abstract_batch)
    assert undeclared(metrics) == []
    expected = {"loss", "grad_norm"}
    if model == "moe":
        expected |= {"expert_load_max_over_mean", "router_aux_loss"}
    if objective == "dpo":
        expected |= {m.name for m in METRICS if m.when == "train.objective=dpo"}
    if objective == "grpo":  # the step's own; the rollouts' come from the host (test_grpo checks them)
        expected |= {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy", "kl"}
    assert set(metrics) == expected


@pytest.mark.fast
def test_the_metrics_of_passkey_evaluations_and_gpu_steps_are_declared(monkeypatch):
    """What a stage's passkey evaluation and a step on a GPU add (from the functions that make them)."""
    import jax

    from jlong.eval import passkey
    from jlong.training import loop

    trial = passkey.Trial(length=8, depth=0.5, row=np.zeros(9, np.int32), answer=np.array([3, 4]))
    assert undeclared({"eval_passkey": passkey.accuracy([trial], np.ones((1, 9)))}) == []

    class Device:
        def memory_stats(self):
            return {"peak_bytes_in_use": 1 << 30}

    monkeypatch.setattr(jax, "local_devices", lambda: [Device()])
    assert loop.device_memory() and undeclared(loop.device_memory()) == []
    assert undeclared(loop.mfu(1.0, 1.0, 1.0)) == []


# ---------------------------------------------------------------- the site


def test_the_site_builds_strictly_and_its_reference_pages_name_everything(tmp_path):
    """mkdocs build --strict of the whole site (every link and anchor checked; a warning fails it), then the
    built HTML of the reference pages: every field's anchor, every argument, preset and metric."""
    site = tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site),
                            "--config-file", str(REPO / "mkdocs.yml")],
                           capture_output=True, text=True, cwd=REPO, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stdout + built.stderr
    assert {uri for uri in PAGES} == {"reference/config.md", "reference/cli.md", "reference/families.md",
                                      "reference/metrics.md"}
    read = {name: (site / "reference" / name / "index.html").read_text() for name in
            ("config", "cli", "families", "metrics")}
    anchor = lambda path: f'id="{path.replace("[]", "")}"'  # noqa: E731
    assert absent(read["config"], config_fields(), form=anchor) == []
    assert absent(read["config"], ["train.seq_len", "train.no_such_field"], form=anchor) == ["train.no_such_field"]
    assert cli_absent(read["cli"], cli_arguments(), form=lambda name: f">{html.escape(name, quote=False)}</code>",
                      heading=('<h2 id="', '"')) == []
    assert absent(read["families"], preset_names(), form=lambda name: f'id="preset-{name}"') == []
    assert absent(read["metrics"], metric_names_to_show(), form=lambda name: html.escape(name, quote=False)) == []
    assert (site / "results" / "gpu-truth" / "index.html").is_file()  # results pages join the site
    assert not (site / "hooks.py").exists()


@pytest.mark.fast
def test_nothing_in_jlong_imports_the_reference_generator():
    """The generator (`jlong.docgen`) reads jlong; jlong never reads it (imports anywhere in a module counted)."""
    import ast

    importers = []
    for path in (REPO / "jlong").rglob("*.py"):
        if "docgen" in path.relative_to(REPO / "jlong").parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):  # `from jlong import docgen` too
                names = [node.module or "", *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            if any(name == "jlong.docgen" or name.startswith("jlong.docgen.") for name in names):
                importers.append(str(path.relative_to(REPO)))
    assert importers == []
