"""The `jlong` command line: train, eval, generate, plan, maxlen, convert, verify, prepare.

Every user error ends as one line on stderr and exit status 2, before any
compilation and without a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

from jlong.errors import JlongError, RunFailure
from jlong.jax_startup import import_jax_quietly, start_backends

EXIT_FAILURE, EXIT_USAGE = 1, 2
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report it: the run stopped before its last step


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise JlongError(f"{message} (see '{self.prog} --help')")


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run config YAML (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="config overrides")


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    from jlong.planner.targets import DEFAULT_HOST_BUDGET_GIB, TARGETS

    parser.add_argument(
        "--target", help=f"what to compile for: {', '.join(TARGETS)}. GPU targets compile the whole mesh "
        "with XLA:GPU, deviceless, on any machine with the CUDA plugin (in a clone: pip install -e \".[gpu-plan]\", "
        "about 2.7 GB); "
        "cpu compiles for virtual CPU devices, corrected toward the GPU program. Default: h100 where the "
        "plugin is installed, cpu elsewhere",
    )
    parser.add_argument(
        "--budget-gib", type=float, help="device memory per GPU (default: train.gpu_memory_fraction of the "
        "target's memory, less a 2 GiB reserve; the cpu target plans for an H100)",
    )
    parser.add_argument(
        "--host-budget-gib", type=float, default=DEFAULT_HOST_BUDGET_GIB,
        help=f"host memory per node for offloaded activations (default: {DEFAULT_HOST_BUDGET_GIB:g})",
    )
    parser.add_argument("--gpus-per-node", type=int, default=8, help="devices per node (default: 8)")
    parser.add_argument("--devices", type=int, help="the device count to plan for; the mesh must match it")
    parser.add_argument(
        "--efficiency", nargs="+", metavar="KEY=VALUE", default=[],
        help="the step-cost estimate's efficiencies: shares of the data-sheet rates (gemm 0.70, grouped_matmul "
        "0.23, grouped_matmul_mosaic 0.13, gated_delta 0.046, gated_delta_mosaic 0.023, attention_fwd 0.60, "
        "attention_bwd 0.53, hbm 0.80, links 0.80, all_to_all 0.70) and launch_us (2.0) per kernel. Put it after "
        "the config's overrides.",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jlong", description="Long-context transformer training on JAX meshes.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = commands.add_parser("train", help="train a model")
    _config_arguments(train)
    train.add_argument("--coordinator", help="multi-process: coordinator host:port")
    train.add_argument("--num-processes", type=int, help="multi-process: number of processes")
    train.add_argument("--process-id", type=int, help="multi-process: this process's index")
    train.add_argument("--until-step", type=int, help="stop after this step (the schedule still spans train.steps)")
    train.add_argument(
        "--dry-run", action="store_true",
        help="check the launch without training: the devices found, the mesh, the data, the steps, where outputs "
        "go, and the compiled step's memory; nothing is written",
    )
    train.set_defaults(handler=_train)

    evaluate = commands.add_parser(
        "eval", help="loss by position and passkey retrieval of a checkpoint, forward pass only",
        description="Runs the model's forward pass on the config's mesh and attention layout at train.seq_len: the "
        "held-out loss of eval.path (or of eval.mix, by source too) by position (power-of-two buckets) and passkey "
        "retrieval accuracy per (length, depth). Writes eval.json, position_loss.png and passkey.png to --out (default: run_dir/eval/step-N).",
    )
    _config_arguments(evaluate)
    evaluate.add_argument("--checkpoint", required=True, help="a jlong checkpoint directory (its newest step) or a "
                          "Hugging Face directory")
    evaluate.add_argument("--json", action="store_true", help="print the result as one JSON object")
    evaluate.add_argument("--out", help="where to write eval.json and the plots")
    evaluate.set_defaults(handler=_eval)

    plan = commands.add_parser(
        "plan", help="per-device memory and the estimated cost of the configured train step, compiled ahead of time",
        description="Compiles the train step for the configured mesh with abstract inputs (nothing "
        "is allocated) and reports per-device bytes (parameters, gradients, optimizer state, "
        "inputs, peak temporaries and host-offloaded bytes) against the device and host budgets, "
        "then what the step costs, read from the compiled program: FLOPs, collective and host "
        "traffic, kernel launches and an estimated step time (an estimate, not a measurement).",
    )
    _config_arguments(plan)
    _plan_arguments(plan)
    plan.add_argument("--json", action="store_true", help="print one JSON object (bytes)")
    plan.add_argument("--eval", action="store_true", help="plan the eval program (the forward pass of jlong eval and "
                      "train.eval_every) instead of the train step; memory only, no step cost")
    plan.add_argument("--generate", action="store_true", help="plan generation (jlong generate) instead of the train "
                      "step: the caches' bytes per device, the prefill's and a decode call's peaks, their estimated "
                      "times on GPU targets, and the longest prompt that fits")
    plan.add_argument("--prompt-tokens", type=int, help="with --generate: each prompt's tokens (default: half of "
                      "train.seq_len)")
    plan.add_argument("--new-tokens", type=int, default=256, help="with --generate: new tokens per prompt (default: "
                      "256)")
    plan.add_argument("--batch", type=int, default=1, help="with --generate: prompts generated together "
                          "(default: 1)")
    plan.set_defaults(handler=_plan)

    maxlen = commands.add_parser(
        "maxlen", help="the longest train.seq_len whose planned step fits the budgets",
        description="Plans the configured train step at growing sequence lengths (doubling, then "
        "bisection, each a multiple of sp times the tiles) and reports the longest that fits both budgets: device memory per device "
        "(--budget-gib) and host memory per node (--host-budget-gib), saying which binds. With "
        "--fastest, ranks the --search settings by estimated tokens/s at the configured length.",
    )
    _config_arguments(maxlen)
    _plan_arguments(maxlen)
    maxlen.add_argument(
        "--search", nargs="+", metavar="KEY=V1,V2", default=[],
        help="also search over these settings (every combination), e.g. --search "
        "memory.layers_per_checkpoint=1,2,4 attention.heads_per_stage=8,16; reports the setting that "
        "reaches the longest length. mesh.ring=1,2,4 alone keeps the devices (sp takes the rest). "
        "Put it after the config's overrides.",
    )
    maxlen.add_argument(
        "--fastest", action="store_true",
        help="rank the --search settings by estimated tokens/s at the configured train.seq_len instead of "
        "searching for the longest length: each is planned once, and the fastest that fits both budgets wins",
    )
    maxlen.set_defaults(handler=_maxlen)

    generate = commands.add_parser(
        "generate", help="complete prompts with the model, on the config's mesh",
        description="Completes each prompt of --prompts (JSON Lines: prompt_ids, or prompt as text or a conversation "
        "rendered with the tokenizer's chat template) --num-samples times on the config's mesh: the prefill is the "
        "training forward (the same attention method and kernels), decoding one token per sequence against caches "
        "split as the sequence is. Writes one JSON line per prompt and sample to --out (index, sample, "
        "prompt_tokens, completion_ids, logprobs, finish_reason, completion with a tokenizer, and the prompt's other "
        "fields), as they come. A prompt plus --max-new-tokens must fit train.seq_len. Stops a sequence at the "
        "checkpoint's eos_token_id (generation_config.json or config.json) and at each --stop-id.",
    )
    _config_arguments(generate)
    generate.add_argument("--prompts", required=True, help="a JSON Lines file of prompts (Parquet or a datasets "
                          "directory too)")
    generate.add_argument("--out", required=True, help="the JSON Lines file to write (never written over)")
    generate.add_argument("--checkpoint", help="weights: a jlong checkpoint or run directory (a LoRA run's adapters "
                          "over its base), or a Hugging Face directory; default: the config's (model.hf_path, "
                          "train.init_from, or a preset's random start)")
    generate.add_argument("--tokenizer", help="a tokenizer directory (or tokenizer.json): text prompts, "
                          "conversations, and the completions' text")
    generate.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per completion at most "
                          "(default: 256)")
    generate.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default: 1)")
    generate.add_argument("--top-p", type=float, default=1.0, help="keep the most likely tokens whose probability "
                          "reaches p (default: 1, all)")
    generate.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0, all)")
    generate.add_argument("--num-samples", type=int, default=1, help="completions per prompt, sharing its prefill "
                          "(default: 1)")
    generate.add_argument("--seed", type=int, default=0, help="the draws' seed: the same seed gives the same "
                          "samples on any mesh (default: 0)")
    generate.add_argument("--stop-id", type=int, action="append", default=[], dest="stop_ids",
                          help="a token id that ends a completion (repeatable), besides the checkpoint's eos ids")
    generate.set_defaults(handler=_generate)

    convert = commands.add_parser(
        "convert", help="Hugging Face checkpoint <-> jlong parameters; a LoRA run's adapters -> PEFT",
        description="HF_DIR -> jlong parameter checkpoint, or a jlong checkpoint -> HF_DIR "
        "(the direction follows from what SOURCE holds). A LoRA run's checkpoint (its adapters alone) becomes a "
        "PEFT adapter directory (adapter_config.json, adapter_model.safetensors) that peft.PeftModel."
        "from_pretrained loads onto the run's base model, or with --merge a whole Hugging Face checkpoint.",
    )
    convert.add_argument("source", help="a Hugging Face directory, or a jlong checkpoint directory")
    convert.add_argument("destination", help="where to write the converted checkpoint")
    convert.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"),
                         help="the dtype of the weights written (a PEFT directory's adapters too)")
    convert.add_argument(
        "--merge", action="store_true",
        help="of a LoRA run's checkpoint, write a Hugging Face checkpoint of its base (read again from the run's "
        "model.hf_path) with the adapters merged into the weights. A QLoRA run's adapters are merged into the "
        "full-precision base, not its NF4 form: the merged model differs from the one trained by the base's "
        "quantization error",
    )
    convert.set_defaults(handler=_convert)

    verify = commands.add_parser(
        "verify", help="check a checkpoint directory's files against the sizes and checksums written with them",
        description="Compares every step of CHECKPOINT_DIR with the sizes and CRC-32 checksums its processes "
        "recorded when they wrote it, reading each file once; changes nothing. Exit status 0 when every step is "
        "intact, 2 with a line naming each damaged step's first damaged file.",
    )
    verify.add_argument("checkpoint_dir", help="a checkpoint directory (checkpoint.dir of a run)")
    verify.set_defaults(handler=_verify)

    prepare = commands.add_parser(
        "prepare", help="a corpus -> a .npy of token ids (or a directory of shards) with document indices",
        description="Tokenizes text files, JSON Lines (.jsonl), Parquet (.parquet) and 'datasets' directories "
        "(save_to_disk) in one streaming pass, in batches on every core, each document followed by the "
        "end-of-document id, and writes OUT.npy with OUT.documents.npy (document offsets), OUT.documents.json "
        "(length summary) and OUT.documents.png (length histogram). With --shard-tokens or --shard-per-input, OUT "
        "is a directory of shards part-NNNNN.npy (each with its index), numbered after any already there; "
        "data.path reads the directory as one corpus. With --chat, each record's messages are a conversation, "
        "rendered with the tokenizer directory's chat template, and OUT.mask.npy marks the ids to train on "
        "(np.packbits, one bit per id); training on the file trains those alone. With --preference, each record "
        "is a preference pair (prompt, chosen, rejected: strings or conversations, TRL's format) tokenized as TRL's "
        "DPO trainer does, written as two adjacent documents (prompt + chosen, prompt + rejected) with the "
        "completions marked in OUT.mask.npy and OUT.pairs.npy ([pairs, 2] first offsets of each pair's documents); "
        "train.objective=dpo trains on them.",
    )
    prepare.add_argument("output", help="the .npy file to write, or the shard directory")
    prepare.add_argument("inputs", nargs="+", help="files or directories")
    prepare.add_argument("--glob", default="*", help="file pattern inside directories (default: all)")
    prepare.add_argument("--text-field", default="text", help="the text's field or column in JSON Lines, Parquet "
                         "and datasets (default: text)")
    prepare.add_argument("--tokenizer", help="a Hugging Face tokenizer.json or a directory holding one "
                         "(default: bytes)")
    prepare.add_argument("--eos-id", type=int, help="end-of-document id (bytes: 0; a tokenizer directory: its "
                         "eos_token; with --chat: the first of eos_token, pad_token and the end-of-text tokens that "
                         "the chat template never writes)")
    prepare.add_argument("--chat", action="store_true", help="conversations: each record's messages, a list of "
                         "{role, content} turns, rendered with the chat template of --tokenizer (a directory)")
    prepare.add_argument("--messages-field", default="messages", help="with --chat: the conversation's field or "
                         "column (default: messages)")
    prepare.add_argument("--train-on", default="assistant", choices=("assistant", "last", "all"),
                         help="with --chat: the ids to train on: every assistant turn through the token that "
                         "closes it (default), the last assistant turn only, or every id")
    prepare.add_argument("--preference", action="store_true", help="preference pairs: each record's prompt, "
                         "chosen and rejected (strings, or conversations rendered with the chat template of "
                         "--tokenizer), with TRL's DPO ids")
    prepare.add_argument("--max-len", type=int, help="with --preference: refuse a pair whose two documents hold more "
                         "tokens than this (give the run's train.seq_len)")
    prepare.add_argument("--max-tokens", type=int, help="stop after this many tokens (default: the whole corpus)")
    prepare.add_argument("--vocab-size", type=int, help="the model's vocabulary: refuse a tokenizer with more ids")
    prepare.add_argument("--shard-tokens", type=int, help="start a new shard once one holds this many tokens "
                         "(documents stay whole)")
    prepare.add_argument("--shard-per-input", action="store_true", help="one shard per input file or dataset")
    prepare.add_argument("--workers", type=int, help="threads of the tokenizer's batch encoding (default: every core)")
    prepare.set_defaults(handler=_prepare)
    return parser


def _parse(argv: list[str] | None):
    """Parses a command line where overrides may also follow the options
    (`jlong maxlen CONFIG --budget-gib 80 mesh.sp=8`): argparse leaves
    positionals after an option unmatched, so they are taken as overrides."""
    parser = build_parser()
    args, unmatched = parser.parse_known_args(argv)
    if unmatched:
        stray = [a for a in unmatched if a.startswith("-") or "=" not in a]
        if stray or not hasattr(args, "overrides"):
            raise JlongError(f"unrecognized arguments: {' '.join(stray or unmatched)} "
                             f"(see 'jlong {args.command} --help')")
        args.overrides = [*args.overrides, *unmatched]
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns the exit status."""
    from jlong.training.preemption import StopRequests

    stop_requests = StopRequests()
    try:
        args = _parse(argv)
        if args.command in ("plan", "maxlen"):
            # XLA's warnings are not the plan's: its remat pass reports totals that count host buffers.
            os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        if args.command == "train":  # before jax starts: a stop signal during start-up is kept, not fatal
            stop_requests = args.stop_requests = StopRequests.installed()
        if args.command not in ("prepare", "verify"):  # they never need jax
            import_jax_quietly()
            import jlong.components  # noqa: F401  (the families and methods a config names register themselves)
        return args.handler(args) or 0
    except JlongError as err:
        print(f"jlong: error: {err.for_command_line()}", file=sys.stderr)
        return EXIT_USAGE
    except RunFailure as err:
        print(f"jlong: error: {err}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("jlong: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        stop_requests.uninstall()


def run() -> None:
    """The `jlong` command. After a run failure (a checkpoint write that
    failed) the process ends at once: orbax's writer threads that went wrong
    would otherwise report it again, with tracebacks, while Python shuts down."""
    status = main()
    if status == EXIT_FAILURE:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


def _train(args) -> int:
    from jlong.config import load_config
    from jlong.planner.gpu_memory import apply_memory_fraction
    from jlong.training.multihost import initialize_distributed, process_count_requested, shutdown_distributed

    from jlong.training.loop import checked_last_step

    config = load_config(args.config, args.overrides)
    checked_last_step(config, args.until_step)
    processes = process_count_requested(args.num_processes)
    if config.mesh.size % processes:
        raise JlongError(f"the mesh's {config.mesh.size} devices do not split over {processes} processes")
    memory_fraction = apply_memory_fraction(config.train.gpu_memory_fraction)
    initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    start_backends(cpu_devices=config.mesh.size // processes)
    import jax

    if jax.default_backend() == "gpu" and jax.process_index() == 0:
        print(f"GPU memory for XLA: {memory_fraction.describe()}", flush=True)
    if args.dry_run:
        from jlong.training.dry_run import describe

        description = describe(config, args.until_step)
        if jax.process_index() == 0:
            print(description)
        shutdown_distributed()
        return 0
    from jlong.training.loop import train

    train(config, until_step=args.until_step, stop_requests=args.stop_requests)
    shutdown_distributed()
    return EXIT_INTERRUPTED if args.stop_requests.stopped_by == signal.SIGINT else 0


def _eval(args) -> int:
    import json
    from pathlib import Path

    from jlong.config import load_config

    from jlong.eval.evaluate import at_checkpoint, eval_inputs

    config = load_config(args.config, args.overrides, check_stages=False)  # the checkpoint's stage decides
    config = at_checkpoint(config, args.checkpoint, args.overrides)
    inputs = eval_inputs(config)
    start_backends(cpu_devices=config.mesh.size)
    from jlong.eval import report
    from jlong.eval.evaluate import evaluate
    from jlong.parallel.placement import make_mesh

    result = evaluate(config, args.checkpoint, make_mesh(config.mesh), inputs)
    default = Path(config.run_dir) / "eval" / f"step-{result['step']}" if config.run_dir else None
    out, earlier = report.destination(default, Path(args.out) if args.out else None)
    written = report.write(result, out) if out else []
    if args.json:
        print(json.dumps(result))
        if earlier:
            print(earlier, file=sys.stderr)
    else:
        print(report.summary(result))
        for path in written:
            print(f"wrote {path}")
        if earlier:
            print(earlier)
    return 0


def _generate(args) -> int:
    from jlong.completions import GenerateRequest, checked_request, generate
    from jlong.config import load_config

    request = GenerateRequest(
        prompts=args.prompts, out=args.out, checkpoint=args.checkpoint, tokenizer=args.tokenizer,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        num_samples=args.num_samples, seed=args.seed, stop_ids=tuple(args.stop_ids))
    checked = checked_request(load_config(args.config, args.overrides, check_stages=False), request)
    start_backends(cpu_devices=checked.config.mesh.size)
    records = generate(checked, request)
    print(f"wrote {len(records):,} completions to {args.out}")
    return 0


def _plan(args) -> int:
    import json

    from jlong.config import load_config
    from jlong.config.stages import stage_runs
    from jlong.planner.memory import format_plan

    config = load_config(args.config, args.overrides)
    efficiency = _efficiency(args)
    target = _plan_target(config, args)
    if args.generate:
        return _plan_generation(config, target, efficiency, args)
    stages = stage_runs(config)
    say = _progress(args.json)
    planned = []
    for stage in stages:  # each stage with its auto settings chosen (jlong.planner.memory_choice)
        if len(stages) > 1:
            say(f"stage {stage.number} of {len(stages)}:")
        resolved, *plan_parts = _plan_one(stage.config, target, efficiency, args.eval, say)
        planned.append((dataclasses.replace(stage, config=resolved), *plan_parts))
    # A run in stages fits when every stage does; its report leads with the stage that needs the most.
    stage, result, cost_keys, _, cost = max(planned, key=lambda p: (not p[1].fits, p[1].device_total))
    rollout = None
    if config.train.objective == "grpo" and not args.eval:  # a step is its rollout and its training
        from jlong.planner.rollout import plan_rollout

        say("compiling the rollout's prefill and decode ...")
        rollout = plan_rollout(stage.config, target, result, cost.step_time_s if cost else None, efficiency)
        cost_keys = {**cost_keys, "rollout": rollout.as_dict()}
    costs = [(s.last - s.first + 1) * cost.step_time_s for s, _, _, _, cost in planned if cost is not None]
    recipe_s = sum(costs) if len(costs) == len(planned) and len(stages) > 1 else None
    if args.json:
        report = {**result.as_dict(), **cost_keys}
        if len(stages) > 1:
            report.update(stage=stage.number, recipe_time_s=recipe_s, stages=[
                {"stage": s.number, "steps": [s.first, s.last], "seq_len": s.config.train.seq_len, **r.as_dict(), **c}
                for s, r, c, _, _ in planned])
        print(json.dumps(report))
    else:
        if args.eval:
            print("program: eval (forward only: jlong eval, train.eval_every)")
        for each, each_result, _, each_cost_lines, _ in planned:
            if len(stages) > 1:
                print(f"stage {each.number} of {len(stages)}: steps {each.first}-{each.last} at seq_len "
                      f"{each.config.train.seq_len:,}")
            print(format_plan(each_result, each.config))
            print(f"device budget: {target.describe_budget(each.config.train.gpu_memory_fraction)}")
            for line in each_cost_lines:
                print(line)
        if recipe_s is not None:
            print(f"the whole recipe, {config.train.steps:,} steps: estimated {recipe_s / 3600:,.1f} h (each "
                  "stage's estimated step time x its steps; an estimate, not a measurement)")
        for line in rollout.lines() if rollout else ():
            print(line)
    if rollout and not rollout.fits:
        sys.stdout.flush()
        raise JlongError(f"the GRPO rollout needs {rollout.device_total / 2**30:.2f} GiB per device, over the budget "
                         "of {:.2f} GiB: fewer prompts or completions a step, shorter rl.max_new_tokens, or more "
                         "devices".format(rollout.generation.budget / 2**30))
    if not result.fits:
        from jlong.planner.advice import over_budget_error

        sys.stdout.flush()
        raise over_budget_error(result, stage.config)
    return 0


def _plan_generation(config, target, efficiency, args) -> int:
    import json

    from jlong.planner.generation import format_generation_plan, plan_generation
    from jlong.planner.memory_choice import frugal

    config = frugal(config)  # nothing is kept for a backward pass
    prompt_tokens = args.prompt_tokens or config.train.seq_len // 2
    say = _progress(args.json)
    say(f"compiling the prefill and a decode call for {config.mesh.size} devices, {prompt_tokens:,}-token prompts, "
        f"with {target.compiler()}, then two more lengths for the longest prompt ...")
    planned = plan_generation(config, target, prompt_tokens=prompt_tokens, new_tokens=args.new_tokens,
                              batch=args.batch, efficiency=efficiency)
    print(json.dumps(planned.as_dict()) if args.json else format_generation_plan(planned, config))
    if not planned.fits:
        sys.stdout.flush()
        raise JlongError(f"generation needs {planned.device_total / 2**30:.2f} GiB per device, over the budget of "
                         f"{planned.budget / 2**30:.2f} GiB: shorter prompts, fewer at a time, or more devices "
                         "(mesh.sp)")
    return 0


def _plan_one(config, target, efficiency, forward_only: bool, say):
    """(the config with its auto settings chosen, memory plan, JSON keys, report lines, step cost) of one
    config's train (or eval) program; what it compiles, and the memory choice's decisions, said as they come."""
    from jlong.planner.memory import compile_train_step, plan_of
    from jlong.planner.cost_report import format_cost
    from jlong.planner.memory_choice import choice_dict, choose, frugal
    from jlong.planner.step_cost import cost_dict

    say(_compiling(config, target, "eval program" if forward_only else "train step"))
    if forward_only:  # memory only: the step-cost model prices a training step
        config = frugal(config)  # no backward pass: nothing to choose what to keep for
        began = time.perf_counter()
        result = plan_of(compile_train_step(config, target, forward_only=True))
        say(f"compiled {_programs(1)} in {time.perf_counter() - began:,.1f} s")
        return config, result, {"program": "eval"}, [], None
    choice = choose(config, target, efficiency=efficiency, say=lambda line: say(f"memory choice: {line}"))
    say(f"compiled {_programs(choice.compiles)} in {choice.seconds:,.1f} s")
    cost = choice.chosen.cost
    lines = [format_cost(cost)]
    keys = {"program": "train", **cost_dict(cost), **choice_dict(choice)}
    return choice.config, choice.chosen.plan, keys, lines, cost


def _progress(json_report: bool):
    """How a plan says what it is compiling (it can take minutes): on stdout before the report, or with --json
    on stderr where that is a terminal (and not at all into a pipe, which expects only the JSON)."""
    if not json_report:
        return lambda line: print(line, flush=True)
    if sys.stderr.isatty():
        return lambda line: print(line, file=sys.stderr, flush=True)
    return lambda line: None


def _compiling(config, target, program: str) -> str:
    """The line before a plan's compile, as `jlong train` says it before its own."""
    mesh = config.mesh
    auto = "; memory.remat or attention.heads_per_stage is auto: several programs" if config.chooses_layout else ""
    return (f"compiling the {program} for {mesh.size} devices (data {mesh.data} x fsdp {mesh.fsdp} x ring "
            f"{mesh.ring} x sp {mesh.sp}), {config.train.seq_len:,} tokens per sequence, with {target.compiler()}"
            f"{auto} ...")


def _programs(count: int) -> str:
    return "1 program" if count == 1 else f"{count} programs"


def _efficiency(args):
    from jlong.planner.pricing import Efficiency

    return Efficiency().with_overrides(args.efficiency)


def _maxlen(args) -> int:
    from jlong.config import load_config

    config = load_config(args.config, args.overrides)
    efficiency = _efficiency(args)
    if args.fastest and not args.search:
        raise JlongError("--fastest ranks the settings of --search: name some, e.g. --search "
                         "memory.remat=offload_inputs,offload_attention")
    target = _plan_target(config, args)
    if args.fastest:
        if not target.is_gpu:
            from jlong.planner.targets import GPU_PLAN_INSTALL

            raise JlongError("--fastest ranks settings by the step cost, which is read from XLA:GPU programs: "
                             f"plan with --target h100 ({GPU_PLAN_INSTALL})")
        return _fastest(config, target, args.search, efficiency)
    from jlong.planner.maxlen import best_length, longest_by_setting, probe_head, probe_verdict, with_seq_len
    from jlong.planner.targets import GIB

    _print_budgets(config, target, f"lengths are multiples of {config.sequence_granule:,}")
    lines = _ProbeLines()

    def announce(setting):
        if args.search:
            print(f"setting {' '.join(setting)}:", flush=True)

    def refused(setting, err):
        lines.end()
        print(f"  no length fits: {err}", flush=True)

    with lines:
        results = longest_by_setting(
            config, target, args.search, on_setting=announce, on_refused=refused,
            on_start=lambda seq_len: lines.start(probe_head(seq_len)),
            on_probe=lambda seq_len, result: lines.finish(probe_verdict(result)))
    best = best_length(results)
    if best is None:
        raise results[-1].refusal
    found = best.found
    if not found.seq_len:
        from jlong.planner.advice import over_budget_error

        shortest, result = min(found.probes, key=lambda probe: probe[0])
        sys.stdout.flush()
        raise over_budget_error(result, with_seq_len(best.config, shortest))
    if args.search:
        for other in results:
            if other.found:
                print(f"  {' '.join(other.setting)}: longest {other.found.seq_len:,}; the {other.found.bound_by} "
                      "budget binds")
        print(f"best setting: {' '.join(best.setting)}")
    print(f"longest seq_len that fits: {found.seq_len:,} ({found.plan.device_total / GIB:.2f} GiB per device, "
          f"{found.plan.host_per_node / GIB:,.1f} GiB host per node); the {found.bound_by} budget binds")
    return 0


class _ProbeLines:
    """A search's probes on stdout, one line each: its start printed as its program begins to compile (a minute
    or more at millions of tokens), the rest with the seconds it took once it is planned."""

    def __init__(self):
        self.began = None  # when the open line's compile began; None: no line open

    def start(self, head: str) -> None:
        self.end()
        print(head, end="", flush=True)
        self.began = time.perf_counter()

    def finish(self, rest: str, *, timed: bool = True) -> None:
        seconds = f" ({time.perf_counter() - self.began:,.1f} s)" if timed and self.began is not None else ""
        print(f"{rest}{seconds}", flush=True)
        self.began = None

    def end(self) -> None:
        """Ends a line left open (its probe refused or failed)."""
        if self.began is not None:
            print(flush=True)
            self.began = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.end()


def _print_budgets(config, target, what: str) -> None:
    """The head of a search's report: the compiler, both budgets, and `what` it searches."""
    print(f"target {target.name}: {target.compiler()}", flush=True)
    print(f"budgets: {target.describe_budget(config.train.gpu_memory_fraction)}; "
          f"{target.host_budget_gib:,.0f} GiB host per node; {what}", flush=True)


def _fastest(config, target, search, efficiency) -> int:
    """Every setting planned at the configured length; the fastest that fits wins."""
    from jlong.planner.maxlen import fastest_setting, search_axes, settings
    from jlong.planner.targets import GIB

    _print_budgets(config, target, f"at seq_len {config.train.seq_len:,}")
    lines = _ProbeLines()

    def report(setting, result, cost):
        verdict = "fits" if result.fits else "over the " + " and ".join(result.exceeded) + " budget"
        lines.finish(f"{result.device_total / GIB:.2f} GiB per device, {result.host_per_node / GIB:,.1f} GiB host "
                     f"per node, {verdict}; estimated step {cost.step_time_s:,.1f} s, {cost.tokens_per_s:,.0f} "
                     f"tokens/s, executed / model FLOPs {cost.recompute_factor:.2f}")

    def refused(setting, err):
        lines.finish(f"refused ({err})", timed=False)

    with lines:
        best = fastest_setting(config, target, settings(search_axes(search)), efficiency, on_probe=report,
                               on_refused=refused, on_start=lambda setting: lines.start(f"  {' '.join(setting)}: "))
    if best is None:
        raise JlongError(f"no setting fits both budgets at train.seq_len={config.train.seq_len:,}; "
                         "drop --fastest to search for the longest length each setting reaches")
    setting, result, cost = best
    print(f"fastest setting that fits: {' '.join(setting)} (estimated {cost.tokens_per_s:,.0f} tokens/s, "
          f"{result.device_total / GIB:.2f} GiB per device, {result.host_per_node / GIB:,.1f} GiB host per node)")
    return 0


def _plan_target(config, args):
    """The target and budgets of `jlong plan` / `maxlen`, checked, with the
    backend started on the CPU (planning never touches a real accelerator)."""
    from jlong.api import planning_target

    if args.budget_gib is not None and not args.budget_gib > 0:
        raise JlongError(f"--budget-gib must be positive, got {args.budget_gib:g}")
    if not args.host_budget_gib > 0:
        raise JlongError(f"--host-budget-gib must be positive, got {args.host_budget_gib:g}")
    if args.devices is not None and args.devices != config.mesh.size:
        m = config.mesh
        fill = args.devices / (m.data * m.ring * m.sp)
        hint = f"; mesh.fsdp={fill:g} fills them" if fill == int(fill) and fill >= 1 else ""
        raise JlongError(
            f"--devices {args.devices}, but the mesh data x fsdp x ring x sp = {m.data} x {m.fsdp} x {m.ring} x "
            f"{m.sp} = {m.size}{hint}"
        )
    return planning_target(config, args.target, budget_gib=args.budget_gib, host_budget_gib=args.host_budget_gib,
                           gpus_per_node=args.gpus_per_node)


def _convert(args) -> int:
    from jlong.checkpoint import convert

    from jlong.files import size_of

    start_backends()
    notes: list[str] = []
    written = convert(args.source, args.destination, param_dtype=args.param_dtype, merge=args.merge,
                      say=notes.append)
    total = sum(size_of(path) for path in written)
    names = ", ".join(path.name for path in written)
    if any(path.name == "adapter_config.json" for path in written):
        what = f"a PEFT LoRA adapter directory: {names}"
    elif any(path.name == "config.json" for path in written):
        merged = " with the LoRA adapters merged" if args.merge else ""
        what = f"a Hugging Face checkpoint{merged}: {names}"
    else:
        what = "a jlong checkpoint of the weights (step 0, no optimizer state)"
    print(f"wrote {args.destination}, {what} ({total:,} bytes)")
    for note in notes:
        print(note)
    return 0


def _verify(args) -> int:
    from jlong.checkpoint_integrity import verify_directory

    print(verify_directory(args.checkpoint_dir))
    return 0


def _prepare(args) -> int:
    from jlong.data.prepare import prepare

    summary = prepare(
        args.output, args.inputs, pattern=args.glob, text_field=args.text_field, tokenizer_path=args.tokenizer,
        eos_id=args.eos_id, max_tokens=args.max_tokens, vocab_size=args.vocab_size, shard_tokens=args.shard_tokens,
        shard_per_input=args.shard_per_input, workers=args.workers, chat=args.chat,
        messages_field=args.messages_field, train_on=args.train_on, preference=args.preference,
        max_len=args.max_len,
    )
    length = summary["length"]
    shards = summary.get("shards")
    where = (f"{args.output}: {len(shards)} shards ({Path(shards[0]).name} to {Path(shards[-1]).name})"
             if shards else args.output)
    if args.preference:
        pair_length = summary["pair_length"]
        print(
            f"wrote {where}: {summary['pairs']:,} pairs ({summary['preference']['format']}) in "
            f"{summary['documents']:,} documents, {summary['tokens']:,} tokens, {summary['trained_tokens']:,} "
            f"trained (the completions); end-of-document id {summary['eos_id']}, recorded beside the tokens for "
            f"training; pair length median {pair_length['median']:,.0f}, max {pair_length['max']:,} tokens; mask, "
            f"pairs and index beside {'each shard' if shards else 'it'} (.mask.npy, .pairs.npy, "
            ".documents.npy/.json/.png)"
        )
        return 0
    if args.chat:
        skipped = summary["skipped_conversations"]
        print(
            f"wrote {where}: {summary['documents']:,} conversations, {summary['tokens']:,} tokens, "
            f"{summary['trained_tokens']:,} trained (--train-on {args.train_on}); {skipped:,} conversations "
            f"skipped (nothing to train); end-of-document id {summary['eos_id']}, recorded beside the tokens for "
            f"training; conversation length median {length['median']:,.0f}, max {length['max']:,} tokens; mask "
            f"and index beside {'each shard' if shards else 'it'} (.mask.npy, .documents.npy/.json/.png)"
        )
        return 0
    read = (f"the first {summary['sources']:,} of {summary['sources_found']:,} sources (stopped at --max-tokens "
            f"{args.max_tokens:,})" if summary.get("stopped_at_max_tokens") else f"{summary['sources']:,} sources")
    print(
        f"wrote {where}: {summary['tokens']:,} tokens in {summary['documents']:,} documents from "
        f"{read} (vocab {summary['vocab_size']}, end-of-document id {summary['eos_id']}); "
        f"document length median {length['median']:,.0f}, p90 {length['p90']:,.0f}, max {length['max']:,} tokens; "
        f"index and histogram beside {'each shard' if shards else 'it'} (.documents.npy/.json/.png)"
    )
    return 0
