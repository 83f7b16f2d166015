"""`jlong eval` and `train.eval_every`: the loss by position adds up to the
whole loss, the sharded forward pass scores as one device does, passkey
scoring tells a model that retrieves the key from one that does not, and
every metric reaches TensorBoard (and W&B) as it reaches metrics.jsonl."""

import json
import sys

import jax
import numpy as np
import pytest
from helpers import SMALL_MODEL, run_cli, tensorboard_scalars

from jlong.config import load_config
from jlong.data.prepare import prepare
from jlong.eval import passkey, report
from jlong.eval.evaluate import Evaluator, not_evaluated, passkey_accuracy, position_losses
from jlong.eval.positions import loss_by_position
from jlong.parallel.placement import make_mesh
from jlong.training.loop import train
from jlong.training.metric_sinks import TENSORBOARD_DIR, scalars
from jlong.program.train_program import TrainProgram

BYTES = [*SMALL_MODEL, "model.vocab_size=256"]


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    """Real text as bytes, prepared into documents: the package's own sources."""
    tmp = tmp_path_factory.mktemp("held-out")
    from helpers import REPO

    prepare(str(tmp / "eval.npy"), [str(REPO / "jlong" / "eval")], pattern="*.py")
    return tmp / "eval.npy"


@pytest.mark.fast
def test_buckets_weighted_by_their_tokens_average_to_the_whole_loss():
    rng = np.random.default_rng(0)
    losses, positions = rng.random((3, 100)) * 5, rng.integers(0, 100, (3, 100))
    buckets = loss_by_position(losses, positions, 100)
    assert [(b["start"], b["end"]) for b in buckets][:3] == [(0, 1), (1, 2), (2, 4)] and buckets[-1]["end"] == 100
    assert sum(b["tokens"] for b in buckets) == losses.size
    weighted = sum(b["loss"] * b["tokens"] for b in buckets) / losses.size
    assert weighted == pytest.approx(losses.mean(), rel=1e-12)


def _scored(config, devices, rows):
    program = TrainProgram(config, make_mesh(config.mesh, devices))
    return position_losses(Evaluator(program), program.init_params(seed=0), rows)


@pytest.mark.parametrize("mesh", [
    ["mesh.fsdp=2", "mesh.sp=4", "attention.heads_per_stage=4", "memory.loss_tile=4"],  # fsdp x sp, UPipe, tiles
    ["mesh.fsdp=2", "mesh.ring=2", "mesh.sp=2"],  # a ring (zigzag layout restored)
], ids=["fsdp2-sp4-upipe", "ring2-sp2-fsdp2"])
def test_eval_on_the_sharded_mesh_equals_one_device(mesh, held_out):
    config = load_config(None, [*BYTES, "data.eos_id=0", f"eval.path={held_out}", "eval.sequences=8"])
    from jlong.eval.evaluate import held_out_rows

    rows = held_out_rows(config)
    one = _scored(config, jax.devices()[:1], rows)
    sharded = _scored(load_config(None, [*BYTES, "data.eos_id=0", *mesh]), jax.devices(), rows)
    assert sharded["tokens"] == one["tokens"] == 8 * 64
    assert sharded["loss"] == pytest.approx(one["loss"], rel=1e-5)
    for got, want in zip(sharded["loss_by_position"], one["loss_by_position"], strict=True):
        assert (got["start"], got["end"], got["tokens"]) == (want["start"], want["end"], want["tokens"])
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    weighted = sum(b["loss"] * b["tokens"] for b in one["loss_by_position"]) / one["tokens"]
    assert weighted == pytest.approx(one["loss"], rel=1e-6)


class _Reader:
    """A stand-in for the model that reads the key from the prompt: its most
    likely next tokens after "The pass key is " are the key's digits (or, when
    built to answer wrong, the key with its last digit changed), until `reach`
    tokens into the prompt, past which it sees nothing."""

    def __init__(self, config, *, wrong=False, reach=None):
        self.config, self.wrong, self.reach = config, wrong, reach

    def scores(self, params, rows):
        hits = np.zeros((*rows[:, 1:].shape, 2), np.float32)
        question = passkey.QUESTION.encode()
        for r, row in enumerate(rows):
            text = bytes(row.astype(np.uint8).tolist())
            at = text.index(question) + len(question)
            needle = text.index(b"The pass key is ") + len(b"The pass key is ")
            key = bytearray(text[needle : needle + 5])
            if self.wrong:
                key[-1] = ord("0") + (key[-1] - ord("0") + 1) % 10
            if self.reach is not None and needle > self.reach:
                key = bytearray(b"00000")
            hits[r, at - 1 : at + 4, 1] = np.frombuffer(bytes(key), np.uint8) == row[at : at + 5]
        return hits


@pytest.mark.fast
def test_passkey_scoring_tells_right_answers_from_wrong_ones():
    config = load_config(None, [*BYTES, "train.seq_len=512", "eval.passkey_trials=3",
                                "eval.passkey_lengths=[256,512]", "eval.passkey_depths=[0,0.5,1]"])
    right = passkey_accuracy(_Reader(config), params=None)
    assert [(c["length"], c["depth"], c["trials"], c["accuracy"]) for c in right] == [
        (n, d, 3, 1.0) for n in (256, 512) for d in (0.0, 0.5, 1.0)]
    assert all(c["digit_accuracy"] == 1.0 for c in right)
    # One digit of five wrong: no trial is right, four fifths of the digits are.
    wrong = passkey_accuracy(_Reader(config, wrong=True), params=None)
    assert all(c["accuracy"] == 0.0 and c["digit_accuracy"] == pytest.approx(0.8) for c in wrong)
    # A model that sees only its first 300 tokens finds keys hidden early and misses those hidden late.
    cells = {(c["length"], c["depth"]): c["accuracy"] for c in passkey_accuracy(_Reader(config, reach=300), None)}
    assert cells[256, 1.0] == cells[512, 0.0] == 1.0 and cells[512, 1.0] == 0.0


@pytest.mark.fast
def test_a_passkey_of_one_digit_is_asked_for_as_five_are():
    encode = lambda text: list(text.encode())
    made = passkey.trials(encode, 512, [256, 512], [0.0, 1.0], 4, seed=0, digits=1)
    assert passkey.shortest_prompt(encode, 1) == passkey.shortest_prompt(encode, 5) - 3 * 4  # the key is written 3 times
    for trial in made:
        prompt = bytes(trial.row[: trial.answer[-1] + 1].tolist()).decode()
        key = prompt[-1]
        assert len(trial.answer) == 1 and key.isdigit() and key != "0" and len(prompt) == trial.length
        assert prompt.count(key) == 3 and passkey.NEEDLE.format(key=key) in prompt  # stated twice, then answered
    assert len({bytes(t.row[t.answer].tolist()) for t in made}) > 1  # the keys vary from trial to trial


@pytest.mark.fast
def test_the_report_writes_what_it_summarises(tmp_path):
    result = {"checkpoint": "ck", "step": 7, "seq_len": 1024, "loss": 2.0, "tokens": 3000,
              "loss_by_position": [{"start": 0, "end": 1, "tokens": 1000, "loss": 3.0},
                                   {"start": 1, "end": 1024, "tokens": 2000, "loss": 1.5}],
              "passkey": [{"length": n, "depth": d, "trials": 4, "accuracy": n / 2048 + d / 4}
                          for n in (512, 1024) for d in (0.0, 1.0)]}
    written = report.write(result, tmp_path / "out")
    assert [p.name for p in written] == ["eval.json", "position_loss.png", "passkey.png"]
    assert json.loads((tmp_path / "out" / "eval.json").read_text()) == result
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written[1:])
    text = report.summary(result).splitlines()
    assert text[0] == "checkpoint ck (step 7) at seq_len 1,024"
    assert text[1].startswith("held-out loss 2.0000 (perplexity 7.39) over 3,000 tokens")
    assert text[-2:] == ["   0.00        0.25      0.50", "   1.00        0.50      0.75"]


@pytest.mark.fast
def test_a_dpo_evaluation_leads_with_its_objectives_measures():
    """The held-out pairs' DPO loss and TRL's metrics first; the next-token loss of the same files after,
    named as what it is."""
    preference = {"pairs": 64, "rewards/chosen": 0.25, "rewards/rejected": -0.5, "rewards/accuracies": 0.875,
                  "rewards/margins": 0.75, "logps/chosen": -20.0, "logps/rejected": -30.0, "loss": 0.4}
    shown = report.summary({"checkpoint": "ck", "step": 3, "seq_len": 768, "loss": 9.375, "tokens": 500,
                            "loss_by_position": [{"start": 0, "end": 768, "tokens": 500, "loss": 9.375}],
                            "preference": preference, "passkey": []}).splitlines()
    assert shown[1] == ("held-out preference pairs (64), the policy against the run's reference: DPO loss 0.4000, "
                        "rewards/chosen 0.2500, rewards/rejected -0.5000, rewards/accuracies 0.8750, rewards/margins "
                        "0.7500, logps/chosen -20.0000, logps/rejected -30.0000")
    assert shown[2] == ("next-token loss of the held-out completions (not DPO's objective) 9.3750 "
                        "(perplexity 11,789.92) over 500 tokens; by position:")


@pytest.mark.fast
def test_eval_names_what_it_leaves_out():
    config = load_config(None, [*BYTES, "train.seq_len=256"])  # a byte-level prompt takes 173 tokens
    assert not_evaluated(config) == [
        {"what": "loss by position", "why": "no held-out tokens: set eval.path (a .npy made by 'jlong prepare') "
                                            "or eval.mix"},
        {"what": "passkey lengths 32, 64, 128", "why": "a prompt needs 173 tokens (the default lengths are seq_len "
                                                       "/ 8, / 4, / 2 and seq_len; a longer train.seq_len reaches more)"}]
    assert not_evaluated(load_config(None, [*BYTES, "eval.path=x.npy", "eval.passkey_trials=0"])) == [
        {"what": "passkey retrieval", "why": "eval.passkey_trials=0"}]
    shown = report.summary({"checkpoint": "ck", "step": 1, "seq_len": 256, "passkey": [],
                            "not_evaluated": not_evaluated(config)})
    assert shown.splitlines()[1:] == ["not evaluated: loss by position (no held-out tokens: set eval.path (a .npy "
                                      "made by 'jlong prepare') or eval.mix)",
                                      "not evaluated: passkey lengths 32, 64, 128 (a prompt needs 173 tokens (the "
                                      "default lengths are seq_len / 8, / 4, / 2 and seq_len; a longer train.seq_len "
                                      "reaches more))"]


@pytest.mark.fast
def test_an_earlier_evaluation_is_kept_or_said_to_be_replaced(tmp_path):
    default = tmp_path / "eval" / "step-4"
    assert report.destination(default, None) == (default, None)
    report.write({"step": 4, "passkey": []}, default)
    second, said = report.destination(default, None)
    assert second == tmp_path / "eval" / "step-4-2" and said == f"kept the earlier evaluation in {default}; this one " \
                                                                 f"is in {second}"
    report.write({"step": 4, "passkey": []}, second)
    assert report.destination(default, None)[0] == tmp_path / "eval" / "step-4-3"
    assert report.destination(default, default) == (default, f"replaced the earlier evaluation in {default}")
    assert report.destination(None, None) == (None, None)


class _WandbStandIn:
    """W&B is not installed here: a stand-in module records what jlong hands it."""

    def __init__(self):
        self.calls = []

    def init(self, **options):
        return self

    def log(self, values, step):
        self.calls.append((step, values))

    def finish(self):
        self.calls.append("finished")


def test_eval_every_logs_the_loss_by_position_and_every_sink_reads_back_as_metrics_jsonl(tmp_path, held_out,
                                                                                          monkeypatch, capsys):
    wandb = _WandbStandIn()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    # At 256 tokens, which a passkey prompt (173 bytes) fits in.
    config = load_config(None, [*BYTES, "mesh.fsdp=2", "mesh.sp=4", "train.seq_len=256", "train.steps=4",
                                "train.eval_every=2",
                                f"eval.path={held_out}", "eval.sequences=8", "train.log_to=[jsonl,tensorboard,wandb]",
                                f"run_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}"])
    train(config)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert ["eval_loss" in r for r in records] == [False, True, False, True]
    logged = {(name, r["step"]): value for r in records for name, value in scalars(r).items()}
    assert "eval/loss_by_position/0-1" in {name for name, _ in logged}
    events = {(tag, step): value for tag, step, value in tensorboard_scalars(tmp_path / "run" / TENSORBOARD_DIR)}
    assert events.keys() == logged.keys()
    for key, value in logged.items():
        assert events[key] == pytest.approx(value, rel=1e-6), key  # TensorBoard keeps float32
    assert wandb.calls == [(r["step"], scalars(r)) for r in records] + ["finished"]
    shown = capsys.readouterr()  # the held-out loss in the progress lines and the summary
    assert f"eval_loss {records[1]['eval_loss']:.4f}" in shown.err
    assert (f"  eval loss    {records[1]['eval_loss']:.4f} at step 2 -> {records[3]['eval_loss']:.4f} at step 4"
            in shown.out)

    # The checkpoint the run ended with, evaluated by the command line: the same loss at step 4.
    out = tmp_path / "eval"
    config_file = tmp_path / "config.yaml"
    config_file.write_text("{}\n")
    result = run_cli("eval", config_file, *BYTES, "mesh.fsdp=2", "mesh.sp=4", "train.seq_len=256",
                     f"eval.path={held_out}", "eval.sequences=8", "eval.passkey_trials=1",
                     "--checkpoint", tmp_path / "ckpt",
                     "--out", out, "--json")
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed == json.loads((out / "eval.json").read_text())
    assert printed["step"] == 4 and printed["loss"] == pytest.approx(records[-1]["eval_loss"], rel=1e-5)
    assert {"start", "end", "tokens", "loss"} == set(printed["loss_by_position"][0])
    assert {"length", "depth", "trials", "accuracy", "digit_accuracy"} == set(printed["passkey"][0])
    assert (out / "position_loss.png").is_file() and (out / "passkey.png").is_file()
    assert [item["what"] for item in printed["not_evaluated"]] == ["passkey lengths 32, 64, 128"]  # 173 tokens each

    # Evaluated twice more into the run's directory with other settings: both kept, and said so.
    shown = []
    for trials in (1, 2):
        again = run_cli("eval", config_file, *BYTES, "mesh.fsdp=2", "mesh.sp=4", "train.seq_len=256",
                        f"eval.passkey_trials={trials}", f"run_dir={tmp_path / 'run'}", "--checkpoint", tmp_path / "ckpt")
        assert again.returncode == 0, again.stderr
        shown.append(again.stdout)
    first, second = tmp_path / "run" / "eval" / "step-4", tmp_path / "run" / "eval" / "step-4-2"
    assert "not evaluated: loss by position (no held-out tokens" in shown[0] and "kept the earlier" not in shown[0]
    assert f"kept the earlier evaluation in {first}; this one is in {second}" in shown[1]
    assert [json.loads((d / "eval.json").read_text())["passkey"][0]["trials"] for d in (first, second)] == [1, 2]


def test_plan_covers_the_eval_program(tmp_path):
    config = tmp_path / "small.yaml"
    config.write_text("{}\n")
    shape = [*BYTES, "mesh.fsdp=2", "mesh.sp=4", "train.seq_len=256", "--target", "cpu", "--json"]
    train_plan = json.loads(run_cli("plan", config, *shape).stdout)
    result = run_cli("plan", config, *shape, "--eval")
    assert result.returncode == 0, result.stderr
    eval_plan = json.loads(result.stdout)
    assert eval_plan["program"] == "eval" and "step_time_s" not in eval_plan
    assert eval_plan["gradients"] == eval_plan["optimizer_state"] == 0 and eval_plan["parameters"] > 0
    assert 0 < eval_plan["device_total"] < train_plan["device_total"]
