"""Generation (`jlong.generation`, `jlong generate`): greedy tokens are the
argmax of transformers' own forward over prompt + completion and each
logprob its log-softmax, for every family (prompts of several lengths in
one batch, windows shorter than the prompts); the same tokens and logprobs
on the training meshes; draws that follow the model's probabilities after
temperature, top-k and top-p; a LoRA checkpoint that generates what its
merged export generates; bad requests refused in one line."""

import json

import jax
import numpy as np
import pytest
import torch
from helpers import assert_one_line_error, run_cli
from hf_models import small_hf_model

from jlong.config import load_config
from jlong.generation.sampler import Request, Sampler
from jlong.generation.sampling import SamplingSettings
from jlong.parallel.placement import make_mesh
from jlong.program.train_program import TrainProgram

GREEDY = SamplingSettings(temperature=0.0)
PROMPT_LENGTHS = (37, 9, 21)  # past Gemma 3's window of 16 and GPT-OSS's of 8; several shards long on sp 4
NEW_TOKENS = 6


def _prompts(count=len(PROMPT_LENGTHS), vocab=96, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] - i // 3).tolist() for i in range(count)]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (the transformers model, its saved directory), made on first use."""
    made = {}

    def get(name):
        if name not in made:
            model = small_hf_model(name)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            made[name] = (model, path)
        return made[name]

    return get


def _sampler(path, *overrides, batch=3):
    config = load_config(None, [f"model.hf_path={path}", "train.seq_len=64", f"train.batch_size={batch}",
                                "train.compute_dtype=float32", "attention.block_size=16", "data.source=synthetic",
                                *overrides])
    program = TrainProgram(config, make_mesh(config.mesh, jax.devices()[:config.mesh.size]))
    return Sampler(program), program.starting_params()


def _reference_logprobs(hf_model, prompt, ids):
    """transformers' log-softmax [len(ids), V] at each completion token, from its forward over prompt + ids."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + ids])).logits[0].double()
    return torch.log_softmax(logits, -1)[len(prompt) - 1 : len(prompt) - 1 + len(ids)].numpy()


def assert_greedy_is_transformers(hf_model, prompts, completions, atol=1e-4):
    for completion in completions:
        prompt = prompts[completion.prompt_index]
        reference = _reference_logprobs(hf_model, prompt, completion.ids)
        assert len(completion.ids) == NEW_TOKENS and completion.finish_reason == "length"
        for step, (token, logprob) in enumerate(zip(completion.ids, completion.logprobs)):
            best = reference[step].max()
            assert reference[step, token] >= best - 1e-5, (completion.prompt_index, step)  # the argmax (ties aside)
            assert abs(reference[step, token] - logprob) < atol, (completion.prompt_index, step)


SAMPLED = SamplingSettings(temperature=1.0)
PROMPTS = 8  # a whole batch on fsdp 8


@pytest.fixture(scope="module")
def one_device_runs(hf_dirs):
    """name -> (prompts, greedy completions, sampled completions) on one device: 8 prompts, two samples each,
    greedy and drawn at temperature 1 by one compiled decode program (the settings are traced)."""
    made = {}

    def get(name):
        if name not in made:
            sampler, params = _sampler(hf_dirs(name)[1], batch=PROMPTS)
            prompts = _prompts(PROMPTS)
            made[name] = (prompts, *(sampler.generate(params, prompts, Request(NEW_TOKENS, settings, 2, seed=5))
                                     for settings in (GREEDY, SAMPLED)))
        return made[name]

    return get


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3", "gpt-oss", "qwen3.5", "qwen3-moe", "qwen3.5-moe"])
def test_greedy_generation_is_transformers_argmax(name, hf_dirs, one_device_runs):
    prompts, greedy, _ = one_device_runs(name)
    assert [(c.prompt_index, c.sample) for c in greedy] == [(i, n) for i in range(PROMPTS) for n in range(2)]
    assert_greedy_is_transformers(hf_dirs(name)[0], prompts, greedy)


MESHES = {
    "fsdp8": ["mesh.fsdp=8"],
    "sp4-fsdp2-stages": ["mesh.sp=4", "mesh.fsdp=2", "attention.heads_per_stage=4"],
    "ring2-sp2-fsdp2": ["mesh.ring=2", "mesh.sp=2", "mesh.fsdp=2"],
}


@pytest.mark.parametrize("name, mesh", [
    ("llama", "fsdp8"), ("llama", "sp4-fsdp2-stages"), ("qwen3.5", "ring2-sp2-fsdp2"),
    pytest.param("llama", "ring2-sp2-fsdp2", marks=pytest.mark.slow),
    pytest.param("gpt-oss", "sp4-fsdp2-stages", marks=pytest.mark.slow),
])
def test_the_meshes_generate_what_one_device_generates(name, mesh, hf_dirs, one_device_runs):
    """The same greedy and drawn tokens (the seed's), logprobs within 1e-5; the longest prompts (37 tokens)
    span several of each mesh's sequence shards, beside prompts of 9 and 21."""
    prompts, greedy, sampled = one_device_runs(name)
    sampler, params = _sampler(hf_dirs(name)[1], *MESHES[mesh], batch=PROMPTS)
    for want, settings in ((greedy, GREEDY), (sampled, SAMPLED)):
        got = sampler.generate(params, prompts, Request(NEW_TOKENS, settings, 2, seed=5))
        assert [c.ids for c in got] == [c.ids for c in want]
        np.testing.assert_allclose([c.logprobs for c in got], [c.logprobs for c in want], rtol=0, atol=1e-5)


# -- sampling


def _transformers_allowed(logits, settings: SamplingSettings) -> np.ndarray:
    """The logits transformers' own warpers leave (temperature, top-k, top-p in generate's order; -inf cut)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = torch.tensor(logits, dtype=torch.float32)
    warpers = [TemperatureLogitsWarper(settings.temperature)]
    if settings.top_k:
        warpers.append(TopKLogitsWarper(settings.top_k))
    if settings.top_p < 1:
        warpers.append(TopPLogitsWarper(settings.top_p))
    for warper in warpers:
        scores = warper(None, scores)
    return scores.numpy()


DISTRIBUTIONS = {  # [V] logits: a broad distribution and a peaked one
    "broad": np.random.default_rng(0).normal(0, 0.5, 12),
    "peaked": np.array([4.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -3.0]),
}
SETTINGS = [SamplingSettings(1.0), SamplingSettings(0.7, top_k=3), SamplingSettings(1.3, top_p=0.8),
            SamplingSettings(0.9, top_k=5, top_p=0.6)]


@pytest.mark.fast
@pytest.mark.parametrize("settings", SETTINGS, ids=str)
@pytest.mark.parametrize("kind", sorted(DISTRIBUTIONS))
def test_draws_follow_the_probabilities_transformers_leaves(kind, settings):
    """4,000 draws: nothing outside the set transformers' warpers keep, each token's frequency within 4.5
    standard errors of its probability there; the logprobs are of logits / T before the cut."""
    from jlong.generation.sampling import allowed_logits, next_tokens, row_keys

    logits = DISTRIBUTIONS[kind][None].astype(np.float32)
    want = _transformers_allowed(logits, settings)[0]
    logprobs, allowed = jax.jit(allowed_logits)(logits, settings.as_arrays())
    np.testing.assert_array_equal(np.isfinite(np.asarray(allowed)[0]), np.isfinite(want))
    np.testing.assert_allclose(np.asarray(logprobs)[0], np.asarray(jax.nn.log_softmax(logits[0] / settings.temperature)),
                               atol=1e-6)
    draws = 4000
    keys = row_keys(7, np.arange(draws), np.zeros(draws))
    tokens, token_logprobs = jax.jit(next_tokens)(np.repeat(logits, draws, 0), keys, 3, settings.as_arrays())
    tokens = np.asarray(tokens)
    kept = np.isfinite(want)
    assert kept[tokens].all(), "a token outside the allowed set was drawn"
    probs = np.where(kept, np.exp(want - want[kept].max()), 0.0)
    probs /= probs.sum()
    frequency = np.bincount(tokens, minlength=len(probs)) / draws
    np.testing.assert_array_less(np.abs(frequency - probs), 4.5 * np.sqrt(probs * (1 - probs) / draws) + 1e-9)
    np.testing.assert_allclose(np.asarray(token_logprobs), np.asarray(logprobs)[0, tokens], atol=1e-6)


@pytest.mark.fast
def test_a_seed_repeats_exactly_and_keys_each_sequence_on_its_own():
    from jlong.generation.sampling import next_tokens, row_keys

    logits = np.repeat(DISTRIBUTIONS["broad"][None].astype(np.float32), 64, 0)
    settings = SamplingSettings(1.0).as_arrays()
    draw = jax.jit(next_tokens)
    first = np.asarray(draw(logits, row_keys(3, np.arange(64), np.zeros(64)), 0, settings)[0])
    again = np.asarray(draw(logits, row_keys(3, np.arange(64), np.zeros(64)), 0, settings)[0])
    other_seed = np.asarray(draw(logits, row_keys(4, np.arange(64), np.zeros(64)), 0, settings)[0])
    next_step = np.asarray(draw(logits, row_keys(3, np.arange(64), np.zeros(64)), 1, settings)[0])
    np.testing.assert_array_equal(first, again)
    assert (first != other_seed).mean() > 0.5 and (first != next_step).mean() > 0.5
    # a sequence's draws do not depend on its row: the same (prompt, sample) keys anywhere in a batch
    reordered = np.asarray(draw(logits, row_keys(3, np.arange(64)[::-1], np.zeros(64)), 0, settings)[0])
    np.testing.assert_array_equal(reordered, first[::-1])


@pytest.mark.fast
def test_greedy_takes_the_first_of_a_tie_and_the_raw_logprobs():
    from jlong.generation.sampling import next_tokens, row_keys

    logits = np.array([[0.5, 2.0, 2.0, -1.0]], np.float32)
    token, logprob = next_tokens(logits, row_keys(0, [0], [0]), 0, SamplingSettings(0.0, top_k=1).as_arrays())
    assert int(token[0]) == 1
    np.testing.assert_allclose(float(logprob[0]), float(jax.nn.log_softmax(logits[0])[1]), atol=1e-7)


@pytest.mark.fast
@pytest.mark.parametrize("fields, message", [
    ({"temperature": -0.5}, "the temperature must be 0 (greedy) or positive, got -0.5"),
    ({"top_k": -1}, "top-k must be 0 (off) or positive, got -1"),
    ({"top_p": 0.0}, "top-p must be in (0, 1], got 0"),
])
def test_bad_sampling_settings_are_one_line(fields, message):
    from jlong.errors import JlongError

    with pytest.raises(JlongError, match=message.replace("(", "\\(").replace(")", "\\)").replace("[", "\\[")):
        SamplingSettings(**fields)


# -- the command line and the Python API

CHAT_CONFIG = ["train.seq_len=128", "attention.block_size=16"]


def _prompts_file(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.fast
@pytest.mark.parametrize("case", ["empty", "outside", "negative", "too_long", "conversation", "out_exists"])
def test_bad_requests_are_one_line_and_write_nothing(case, tmp_path):
    records = {"empty": [], "outside": [{"prompt_ids": [1, 2, 999]}], "too_long": [{"prompt_ids": [5] * 120}],
               "conversation": [{"prompt": [{"role": "user", "content": "hi"}]}]}.get(case, [{"prompt": "hi"}])
    prompts = _prompts_file(tmp_path / "prompts.jsonl", records)
    out = tmp_path / "out.jsonl"
    if case == "out_exists":
        out.write_text("earlier work\n")
    flags = ["--max-new-tokens", "-3" if case == "negative" else "16"]
    result = run_cli("generate", "configs/tiny-chat.yaml", *CHAT_CONFIG, "--prompts", prompts, "--out", out, *flags)
    message = {
        "empty": f"--prompts '{prompts}' holds no prompts",
        "outside": "line 1: token id 999 is outside the model's vocabulary (0 to 263)",
        "negative": "--max-new-tokens must be at least 1, got -3",
        "too_long": "prompt 0 has 120 tokens: with --max-new-tokens 16 it passes train.seq_len (128)",
        "conversation": "a conversation is rendered with a tokenizer's chat template: give the model's tokenizer",
        "out_exists": f"--out '{out}' exists: jlong generate never writes over a file",
    }[case]
    assert_one_line_error(result, message)
    assert (out.read_text() == "earlier work\n") if case == "out_exists" else not out.exists()


def test_the_command_writes_a_record_per_prompt_and_sample_in_order(tmp_path):
    """Text, a conversation (the chat template's generation prompt) and ids; the other fields pass
    through; a stop id ends a completion, included; the texts are the tokenizer's decoding."""
    from jlong.data.chat import ChatTemplate

    tokenizer = "configs/tokenizers/byte-chatml"
    conversation = [{"role": "user", "content": "What is 2 + 2?"}]
    prompts = _prompts_file(tmp_path / "prompts.jsonl", [
        {"prompt": "The pass key is", "answer": "4"}, {"prompt": conversation, "id": 7},
        {"prompt_ids": [72, 105], "tags": ["a", "b"]}])
    out = tmp_path / "out.jsonl"
    result = run_cli("generate", "configs/tiny-chat.yaml", *CHAT_CONFIG, "--prompts", prompts, "--out", out,
                     "--tokenizer", tokenizer, "--max-new-tokens", "24", "--num-samples", "2", "--temperature", "1.5",
                     "--stop-id", "257", "--stop-id", "10")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["sample"]) for r in records] == [(i, n) for i in range(3) for n in range(2)]
    assert records[0]["answer"] == "4" and records[2]["id"] == 7 and records[4]["tags"] == ["a", "b"]
    rendered = ChatTemplate.load(tokenizer).render(conversation, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert [r["prompt_tokens"] for r in records[::2]] == [15, len(rendered.encode()) - 2 * len("<|im_start|>")
                                                          - len("<|im_end|>") + 3, 2]
    for record in records:
        ids = record["completion_ids"]
        assert 1 <= len(ids) <= 24 and len(record["logprobs"]) == len(ids)
        assert all(lp <= 0 for lp in record["logprobs"])
        stopped = ids[-1] in (257, 10)
        assert record["finish_reason"] == ("stop" if stopped else "length") and (stopped or len(ids) == 24)
        assert not any(i in (257, 10) for i in ids[:-1])
        assert record["completion"] == bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_a_stop_id_ends_each_sequence_at_its_first_occurrence(hf_dirs, one_device_runs):
    """Greedy again with a stop id that the greedy completions hold: each ends just after its first one
    (finish_reason stop), the others run to their length, and the tokens before are the same."""
    prompts, greedy, _ = one_device_runs("llama")
    stop = greedy[0].ids[2]
    sampler, params = _sampler(hf_dirs("llama")[1], batch=PROMPTS)
    stopped = sampler.generate(params, prompts, Request(NEW_TOKENS, GREEDY, 2, seed=5, stop_ids=(stop,)))
    for before, after in zip(greedy, stopped):
        end = before.ids.index(stop) + 1 if stop in before.ids else len(before.ids)
        assert after.ids == before.ids[:end] and after.logprobs == pytest.approx(before.logprobs[:end], abs=1e-6)
        assert after.finish_reason == ("stop" if stop in before.ids else "length")
    assert stopped[0].ids[-1] == stop and len(stopped[0].ids) <= 3


def test_a_lora_checkpoint_generates_what_its_merged_export_generates(hf_dirs, tmp_path):
    """A LoRA run's checkpoint (one step from fresh adapters, so they are not zero) through --checkpoint, and
    its `jlong convert --merge` export as model.hf_path: the same greedy tokens, logprobs within 1e-4, and
    logprobs other than the base's alone."""
    import jlong

    _, base = hf_dirs("qwen3")
    config = [f"model.hf_path={base}", "train.seq_len=64", "train.batch_size=2", "train.compute_dtype=float32",
              "data.source=synthetic", "attention.block_size=16", "mesh.fsdp=2", "mesh.sp=4"]
    lora = [*config, "lora.rank=4", "lora.alpha=16", "train.steps=1", "train.warmup_steps=1", "train.lr=0.05",
            f"checkpoint.dir={tmp_path / 'ckpt'}"]
    jlong.train(jlong.load_config(None, lora))
    assert run_cli("convert", tmp_path / "ckpt", tmp_path / "merged", "--merge").returncode == 0
    prompts = _prompts_file(tmp_path / "prompts.jsonl", [{"prompt_ids": p} for p in _prompts(2)])
    options = dict(prompts=prompts, max_new_tokens=NEW_TOKENS, temperature=0.0)
    adapted = jlong.generate(jlong.load_config(None, lora), checkpoint=tmp_path / "ckpt", **options)
    merged = jlong.generate(jlong.load_config(None, [*config[1:], f"model.hf_path={tmp_path / 'merged'}"]),
                            **options)
    plain = jlong.generate(jlong.load_config(None, config), **options)
    assert [r["completion_ids"] for r in adapted] == [r["completion_ids"] for r in merged]
    np.testing.assert_allclose([r["logprobs"] for r in adapted], [r["logprobs"] for r in merged], atol=1e-4)
    moved = np.abs(np.array([r["logprobs"] for r in adapted]) - np.array([r["logprobs"] for r in plain]))
    assert moved.max() > 1e-3


@pytest.mark.fast
def test_the_checkpoints_eos_ids_stop_generation_beside_the_stop_ids(tmp_path):
    """generation_config.json's eos_token_id (else config.json's) joins --stop-id, as transformers' generate
    takes it."""
    from jlong.completions import GenerateRequest, checked_request

    small_hf_model("llama").save_pretrained(tmp_path / "hf")
    prompts = _prompts_file(tmp_path / "prompts.jsonl", [{"prompt_ids": [3, 4]}])
    config = load_config(None, [f"model.hf_path={tmp_path / 'hf'}", "train.seq_len=64", "data.source=synthetic"])
    request = GenerateRequest(prompts=str(prompts), max_new_tokens=4, stop_ids=(5,))
    (tmp_path / "hf" / "generation_config.json").unlink(missing_ok=True)
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**hf_config, "eos_token_id": 2}))
    assert checked_request(config, request).stop_ids == (5, 2)
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": [90, 91]}))
    assert checked_request(config, request).stop_ids == (5, 90, 91)


# -- evaluation by generated answers


@pytest.mark.fast
def test_an_answer_scores_by_exact_match_or_by_the_values_it_holds():
    from jlong.eval.answers import score

    assert score(" Paris\n", "Paris") == 1.0 and score("Paris, France", "Paris") == 0.0
    assert score("the keys are 31 and 77", ("31", "77", "42")) == pytest.approx(2 / 3)


def test_eval_scores_the_generated_answers(tmp_path):
    """jlong eval with eval.answers_path: answers set to what the model generates greedily (its text up to the
    stop id) for two prompts and to something else for the other two score 0.5, per prompt as they should."""
    import jlong

    config = ["configs/tiny.yaml", ["train.seq_len=128", "attention.block_size=16", "eval.passkey_trials=0",
                                    "eval.answers_max_new_tokens=12", "eval.stop_ids=[10]", "mesh.fsdp=8",
                                    "mesh.sp=1", "checkpoint.dir=null"]]
    prompts = ["def f(x):\n    return", "import os\nimport", "class A:\n    def", "x = [1, 2, 3]\nprint("]
    base = jlong.load_config(config[0], config[1])
    program = TrainProgram(base, make_mesh(base.mesh))
    greedy = Sampler(program).generate(program.init_params(base.train.seed), [list(p.encode()) for p in prompts],
                                       Request(12, GREEDY, stop_ids=(10,)))
    texts = [bytes(c.ids[:-1] if c.finish_reason == "stop" else c.ids).decode("utf-8", "replace") for c in greedy]
    answers = [texts[0], texts[1] + "!", [texts[2][:3], "never-generated"], texts[3]]
    path = _prompts_file(tmp_path / "answers.jsonl", [{"prompt": p, "answer": a} for p, a in zip(prompts, answers)])
    checkpoints = tmp_path / "ckpt"
    from jlong.checkpoint import Checkpoints

    saved = Checkpoints(checkpoints)
    saved.save(1, program.init_params(base.train.seed), model=base.model)
    saved.close()
    result = jlong.evaluate(config[0], checkpoints, [*config[1], f"eval.answers_path={path}"])
    got = result["answers"]
    assert got["trials"] == 4 and got["accuracy"] == pytest.approx((1 + 0 + 0.5 + 1) / 4)
    assert [a["score"] for a in got["answers"]] == [1.0, 0.0, 0.5, 1.0]
    assert [a["generated"] for a in got["answers"]] == texts
