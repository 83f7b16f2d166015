"""Fine-tuning on conversations: `jlong prepare --chat` gives transformers'
chat-template ids and a mask of exactly the assistant tokens; training on
the file counts those tokens alone, the same on every layout; bad input is
one line with nothing written."""

import json

import jax
import numpy as np
import pytest
from chat_fixtures import EVERY_TURN, chat_tokenizer, conversations
from helpers import SMALL_MODEL, assert_one_line_error, assert_same_result, loss_and_grads, run_cli

from jlong.config import load_config
from jlong.config.loading import with_values
from jlong.data.corpus import mask_path
from jlong.data.prepare import prepare
from jlong.data.recorded import with_recorded_data
from jlong.data.sources import Batches
from jlong.eval.evaluate import Evaluator, held_out_rows, position_losses
from jlong.parallel.placement import make_mesh
from jlong.program.train_program import TrainProgram
from jlong.training.loop import train

LAYOUTS = {"fsdp8": ["mesh.fsdp=8"], "sp4-fsdp2": ["mesh.sp=4", "mesh.fsdp=2"],
           "ring2-sp2-fsdp2": ["mesh.ring=2", "mesh.sp=2", "mesh.fsdp=2"]}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {kind: chat_tokenizer(root / kind, kind) for kind in ("chatml", "headers")}


def _jsonl(path, chats, field="messages"):
    path.write_text("".join(json.dumps({field: chat}) + "\n" for chat in chats))
    return path


def _transformers_ids_and_mask(directory, chat):
    from transformers import AutoTokenizer

    out = AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(
        chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), np.asarray(out["assistant_masks"], bool)


def _unpacked(path, count):
    return np.unpackbits(np.load(mask_path(path)))[:count].astype(bool)


@pytest.mark.fast
@pytest.mark.parametrize("kind", ["chatml", "headers"])
def test_ids_and_mask_equal_transformers_chat_template_and_assistant_tokens(tokenizers, tmp_path, kind):
    """The templates mark each assistant turn's text and closing token with {% generation %}: transformers'
    assistant mask is the reference for jlong's, which finds the turns without those marks."""
    chats = [EVERY_TURN, *conversations(6, seed=1)]
    out = tmp_path / "chat.npy"
    summary = prepare(str(out), [str(_jsonl(tmp_path / "c.jsonl", chats))], tokenizer_path=str(tokenizers[kind]),
                      chat=True)
    eos = summary["eos_id"]
    want_ids, want_mask = [], []
    for chat in chats:
        ids, mask = _transformers_ids_and_mask(tokenizers[kind], chat)
        assert eos not in ids
        want_ids += [*ids, eos]
        want_mask += [*mask, False]
    written = np.load(out)
    assert written.tolist() == want_ids
    assert _unpacked(out, len(written)).tolist() == want_mask
    assert summary["trained_tokens"] == sum(want_mask) and summary["documents"] == len(chats)
    # The end id is an end-of-text token the template never writes, not the eos_token closing every turn.
    from tokenizers import Tokenizer

    token = Tokenizer.from_file(str(tokenizers[kind] / "tokenizer.json")).id_to_token(eos)
    assert token == {"chatml": "<|endoftext|>", "headers": "<|end_of_text|>"}[kind]
    recorded = json.loads((tmp_path / "chat.documents.json").read_text())
    assert recorded["eos_id"] == eos and recorded["chat"]["train_on"] == "assistant"


def test_train_on_last_or_all_and_conversations_without_assistant_turns_are_skipped(tokenizers, tmp_path):
    directory = tokenizers["chatml"]
    chats = [EVERY_TURN, [{"role": "user", "content": "no answer here"}], *conversations(3, seed=2)]
    source = _jsonl(tmp_path / "c.jsonl", chats)
    masks = {}
    for train_on in ("assistant", "last", "all"):
        out = tmp_path / f"{train_on}.npy"
        summary = prepare(str(out), [str(source)], tokenizer_path=str(directory), chat=True, train_on=train_on)
        masks[train_on] = _unpacked(out, summary["tokens"])
        assert summary["skipped_conversations"] == (0 if train_on == "all" else 1)
    assert masks["all"].all()
    last_only = []
    for chat in [c for c in chats if any(t["role"] == "assistant" for t in c)]:
        ids, mask = _transformers_ids_and_mask(directory, chat)
        last_turn = max(i for i, turn in enumerate(chat) if turn["role"] == "assistant")
        before, _ = _transformers_ids_and_mask(directory, chat[:last_turn])
        mark = np.zeros(len(ids) + 1, bool)  # transformers' assistant mask, from the last assistant turn on
        mark[len(before) : len(ids)] = mask[len(before) :]
        last_only += mark.tolist()
    assert masks["last"].tolist() == last_only
    assert masks["last"].sum() < masks["assistant"].sum()


@pytest.mark.fast
def test_the_cli_summary_names_conversations_tokens_and_trained_tokens(tokenizers, tmp_path):
    source = _jsonl(tmp_path / "c.jsonl", [EVERY_TURN, [{"role": "user", "content": "hi"}]], field="conversation")
    result = run_cli("prepare", tmp_path / "out.npy", source, "--chat", "--tokenizer", tokenizers["headers"],
                     "--messages-field", "conversation")
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "out.documents.json").read_text())
    assert (f"1 conversations, {summary['tokens']:,} tokens, {summary['trained_tokens']:,} trained (--train-on "
            "assistant); 1 conversations skipped") in result.stdout


def test_shards_carry_their_own_masks_and_read_as_the_whole_file_does(tokenizers, tmp_path):
    from jlong.data.corpus import TokenCorpus

    source = _jsonl(tmp_path / "c.jsonl", conversations(40, seed=5))
    options = {"tokenizer_path": str(tokenizers["chatml"]), "chat": True}
    prepare(str(tmp_path / "whole.npy"), [str(source)], **options)
    summary = prepare(str(tmp_path / "shards"), [str(source)], shard_tokens=500, **options)
    assert len(summary["shards"]) > 2 and all(mask_path(shard).is_file() for shard in summary["shards"])
    whole, shards = TokenCorpus(str(tmp_path / "whole.npy")), TokenCorpus(str(tmp_path / "shards"))
    assert len(shards.files) == len(summary["shards"])  # the masks are not read as shards
    assert np.array_equal(shards.trained(slice(0, len(shards))), whole.trained(slice(0, len(whole))))
    for start, stop in [(3, 700), (499, 1203), (0, 1)]:  # slices across shards and packed bytes
        assert np.array_equal(shards.trained(slice(start, stop)), _unpacked(tmp_path / "whole.npy", stop)[start:])


@pytest.mark.fast
@pytest.mark.parametrize("case", ["no template", "messages not a list", "unknown role", "no tokenizer"])
def test_bad_chat_input_is_one_line_and_writes_nothing(tokenizers, tmp_path, case):
    directory = tokenizers["chatml"]
    good = [EVERY_TURN] * 3
    if case == "no template":
        bare = tmp_path / "bare"
        bare.mkdir()
        (bare / "tokenizer.json").write_bytes((directory / "tokenizer.json").read_bytes())
        directory, chats, message = bare, good, "has no chat template"
    elif case == "messages not a list":
        chats, message = [*good, "just text"], "line 4: the messages must be a non-empty list of {role, content}"
    elif case == "unknown role":
        chats = [*good, [{"role": "narrator", "content": "x"}]]
        message = "line 4: turn 0 has the role 'narrator'; the roles are system, user, assistant, tool"
    else:
        chats, message = good, "--chat needs --tokenizer"
    source = _jsonl(tmp_path / "c.jsonl", chats)
    out = tmp_path / "out" / "chat.npy"
    args = ["prepare", out, source, "--chat"] + ([] if case == "no tokenizer" else ["--tokenizer", directory])
    assert_one_line_error(run_cli(*args), message)
    assert not (tmp_path / "out").exists()


@pytest.mark.fast
@pytest.mark.parametrize("sharded", [False, True])
def test_chats_that_all_are_skipped_are_one_line_and_write_nothing(tokenizers, tmp_path, sharded):
    source = _jsonl(tmp_path / "c.jsonl", [[{"role": "user", "content": "no answer here"}]] * 3)
    out = tmp_path / "out" / ("shards" if sharded else "chat.npy")
    result = run_cli("prepare", out, source, "--chat", "--tokenizer", tokenizers["chatml"],
                     *(["--shard-tokens", "100"] if sharded else []))
    assert_one_line_error(result, "holds no documents (all 3 conversations have nothing to train")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def packed_chats(tokenizers, tmp_path_factory):
    """Short conversations (about 40 tokens), prepared: several pack into one 128-token sequence."""
    root = tmp_path_factory.mktemp("packed")
    source = _jsonl(root / "c.jsonl", conversations(300, seed=3, words=(3, 10)))
    prepare(str(root / "chat.npy"), [str(source)], tokenizer_path=str(tokenizers["chatml"]), chat=True)
    prepare(str(root / "held.npy"), [str(_jsonl(root / "h.jsonl", conversations(40, seed=4, words=(3, 10))))],
            tokenizer_path=str(tokenizers["chatml"]), chat=True)
    return root


def _chat_config(root, *overrides):
    """The small model on the packed conversations, data.eos_id and data.loss_mask as recorded."""
    return with_recorded_data(load_config(None, [*SMALL_MODEL, "model.vocab_size=512", "data.source=tokens",
                                                 f"data.path={root / 'chat.npy'}", "data.sampling=documents",
                                                 "train.seq_len=128", *overrides]))


def _reference_loss(config) -> tuple[float, float]:
    """(masked, unmasked) mean cross-entropy of step 1's batch from seed-0 parameters on one device, from
    the whole logits in float64: the mask applied here, not by the model's loss."""
    one = with_values(config, mesh={"data": 1, "fsdp": 1, "ring": 1, "sp": 1})
    program = TrainProgram(one, make_mesh(one.mesh, jax.devices()[:1]))
    params = program.init_params(seed=0)
    batch = Batches.from_config(one).batch(1)

    def logits(params, batch):
        model = program.bind(params)
        return model.logits(model.hidden_states(batch["inputs"], batch["segment_ids"], batch["positions"]))

    z = np.asarray(jax.jit(logits)(params, program.place_batch(batch)), np.float64)
    z = z - z.max(-1, keepdims=True)
    losses = np.log(np.exp(z).sum(-1)) - np.take_along_axis(z, batch["targets"][..., None], -1)[..., 0]
    mask = batch["loss_mask"]
    return float((losses * mask).sum() / mask.sum()), float(losses.mean())


def test_the_masked_loss_is_a_cross_entropy_over_trained_tokens_the_same_on_every_layout(packed_chats):
    config = _chat_config(packed_chats)
    assert config.data.loss_mask and config.data.eos_id is not None  # both from what prepare recorded
    batch = Batches.from_config(config).batch(1)
    assert batch["segment_ids"][:, -1].min() >= 2  # every sequence packs several conversations
    assert 0.1 < batch["loss_mask"].mean() < 0.9
    masked, unmasked = _reference_loss(config)
    assert abs(masked - unmasked) > 1e-3  # the mask changes the loss
    results = {name: loss_and_grads(_chat_config(packed_chats, *mesh, "memory.loss_tile=16", "memory.mlp_tile=16"),
                                    jax.devices()) for name, mesh in LAYOUTS.items()}
    for name, result in results.items():
        np.testing.assert_allclose(result[0], masked, rtol=1e-5, err_msg=name)
        assert_same_result(result, results["fsdp8"])


def test_a_step_with_no_trained_token_contributes_zero(packed_chats):
    config = _chat_config(packed_chats, "mesh.fsdp=8")
    program = TrainProgram(config, make_mesh(config.mesh, jax.devices()))
    params = program.init_params(seed=0)
    batch = Batches.from_config(config).batch(1)
    batch["loss_mask"] = np.zeros_like(batch["loss_mask"])
    loss, grads = jax.jit(jax.value_and_grad(program.loss))(params, program.place_batch(batch))
    assert float(loss) == 0.0
    assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(grads))


@pytest.mark.fast
def test_a_mixture_trains_chat_by_its_mask_and_plain_text_whole(packed_chats, tmp_path):
    plain = tmp_path / "plain.npy"
    texts = tmp_path / "p.jsonl"
    texts.write_text("".join(json.dumps({"text": "plain text " * 20}) + "\n" for _ in range(30)))
    prepare(str(plain), [str(texts)])
    mix = json.dumps([{"path": str(packed_chats / "chat.npy"), "name": "chat"}, {"path": str(plain), "name": "plain"}])
    config = with_recorded_data(load_config(None, [*SMALL_MODEL, "model.vocab_size=512", "data.source=tokens",
                                                   f"data.mix={mix}", "data.sampling=documents"]))
    assert config.data.loss_mask
    batches = Batches.from_config(config)
    rows = batches.source.sources_of(1)
    batch = batches.batch(1)
    assert batch["loss_mask"][rows == 1].all()  # plain text: every token
    chat_masks = batch["loss_mask"][rows == 0]
    assert 0 < chat_masks.mean() < 1


@pytest.mark.fast
def test_a_mask_of_another_length_is_refused_in_one_line(packed_chats, tmp_path):
    ids = np.load(packed_chats / "chat.npy")
    np.save(tmp_path / "chat.npy", ids)
    np.save(mask_path(tmp_path / "chat.npy"), np.ones(len(ids) - 3, np.uint8))
    config = tmp_path / "run.yaml"
    config.write_text("{}\n")
    result = run_cli("train", config, "--dry-run", *SMALL_MODEL, "model.vocab_size=512", "data.source=tokens",
                     f"data.path={tmp_path / 'chat.npy'}", "data.eos_id=2")
    assert_one_line_error(result, f"but its token file has {len(ids):,} ids")


def test_training_logs_trained_tokens_and_evaluates_trained_tokens_only(packed_chats, tmp_path):
    config = _chat_config(packed_chats, "mesh.fsdp=2", "mesh.sp=4", "train.steps=3", "train.lr=1e-2",
                          f"run_dir={tmp_path / 'run'}", f"eval.path={packed_chats / 'held.npy'}",
                          "train.eval_every=3", "eval.sequences=8")
    records = train(config)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for step, line in enumerate(lines, 1):
        assert line["trained_tokens"] == int(Batches.from_config(config).batch(step)["loss_mask"].sum())
        assert line["trained_tokens"] < 8 * 128
    held = held_out_rows(config)
    assert held.trained[:, 1:].sum() == records[-1]["eval_loss_by_position"][0]["tokens"] + sum(
        b["tokens"] for b in records[-1]["eval_loss_by_position"][1:])
    program = TrainProgram(config, make_mesh(config.mesh, jax.devices()))
    params = program.init_params(seed=0)
    evaluator = Evaluator(program)
    scores = evaluator.scores(params, held.rows, held.eos_ids)[..., 0]
    counted = held.trained[:, 1:]
    assert position_losses(evaluator, params, held)["loss"] == pytest.approx(float(scores[counted].mean()), rel=1e-6)


def test_packed_conversations_train_the_hybrid_mixture_of_experts_family_by_their_mask(packed_chats):
    """Qwen3.5-MoE (a Gated DeltaNet layer, a gated attention layer, routed experts) on sp 4 x fsdp 2: the
    state and the convolution restart at every conversation, and only the answers count."""
    family = ["model.preset=tiny-qwen3.5-moe", "model.vocab_size=512", "model.hidden_size=64",
              "model.intermediate_size=48", "model.moe_intermediate_size=32", "model.num_key_value_heads=2",
              "model.num_hidden_layers=2", "model.full_attention_interval=2", "train.batch_size=2",
              "train.seq_len=256", "mesh.sp=4", "mesh.fsdp=2",
              "train.router_aux_loss=false"]  # the loss compared is the cross-entropy alone
    config = _chat_config(packed_chats, *family)
    masked, _ = _reference_loss(config)
    loss, _ = loss_and_grads(config, jax.devices())
    np.testing.assert_allclose(loss, masked, rtol=1e-5)
