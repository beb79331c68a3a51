"""The command line.

    python -m fvx.run EXPERIMENT.py [a.b=value ...] [--out DIR] [--steps N] [--resume [latest|auto|STEP|PATH]]
    python -m fvx.run EXPERIMENT.py [a.b=value ...] --dry-run [--world N] [--replicate R] [--video FxHxW]
    torchrun --nproc_per_node N -m fvx.run EXPERIMENT.py [a.b=value ...] [--replicate R] [--sp P]
    python -m fvx.run replay RUN_DIR --step N [--experiment FILE]
    python -m fvx.run export RUN_DIR --out FOLDER [--step N] [--role ROLE] [--ema] [--lora] [--format F] [--dtype D]
    python -m fvx.run preprocess EXPERIMENT.py[:recipe] --videos DIR --out DATASET [a.b=value ...]
    python -m fvx.run encode-prompts EXPERIMENT.py[:recipe] PROMPTS.txt --out FILE.safetensors [a.b=value ...]
    python -m fvx.run sample RUN_DIR|EXPORT (--prompt TEXT ... | --prompts FILE) [--out DIR] [options]

``--help`` after an experiment lists its config fields with their current values. ``--resume`` continues the run in
``--out`` from its newest checkpoint, from checkpoint STEP there, or from a checkpoint at PATH (a checkpoint folder,
or a checkpoints or run folder: its newest). ``replay`` recomputes step N of a run and compares its metrics with the
logged ones (fvx.training.replay). ``export`` writes a trained role as a diffusers folder (fvx.training.export).
``preprocess`` encodes videos and captions into FastVideo's parquet, ``encode-prompts`` text into a cond file, with the
experiment's model's encoders (fvx.training.preprocessing). ``sample`` makes videos from prompts with a run's trained
role or an export, with the sampler the run validates it with (fvx.training.sampling).

``--dry-run`` prints, per rank, each role's params, gradients, AdamW state and EMA bytes, the activations of one
differentiated forward and the gathered params, for ``--world`` ranks (default: this launch's) at a ``--video`` of
FRAMESxHEIGHTxWIDTH pixels (fvx.training.dry_run); it allocates no weight. Under torchrun every process joins one
process group (gloo on CPUs, NCCL on GPUs), params are sharded over ``WORLD_SIZE / --replicate`` ranks (HSDP with
``--replicate`` > 1), each rank reads its own slice of the global batch, and only rank 0 logs and writes the run folder.
``--sp P`` (sequence parallelism, fvx.distributed.sequence_parallel): groups of P consecutive ranks hold the same
samples, each 1/P of their video tokens (the params still shard over all ranks); the batch is split over the WORLD_SIZE
/ P data-parallel groups.

Exit status: 0 done; 1 a run stopped (a non-finite loss or gradient, a full disk, a bad sample met mid-run, a
callback that raised), or a replay differs from the log; 2 bad input (an unknown field, a wrong type, a missing file,
data that does not fit the model, a missing, corrupt or mismatched checkpoint, a step the run does not have),
reported in one line on stderr with nothing written. Under torchrun every worker exits with its status and rank 0
prints the line; torchrun then prints its own ``ChildFailedError`` traceback and a failure summary whose root cause is
that line (each rank's error file holds it), and exits 1 itself.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import signal
import sys
import time
from typing import Sequence

import torch.distributed

from fvx import config as fconfig
from fvx.data import parquet
from fvx.distributed import processes, sequence_parallel
from fvx.storage import checkpoint
from fvx.training import (callbacks as fcallbacks, dry_run, experiment, export, loop, preprocessing, replay, resume,
                          run_folder, sampling)
from fvx.training import config_checks, run_lock, tracking
from fvx.training.interrupts import Interrupted

USAGE = ("python -m fvx.run EXPERIMENT.py [a.b.c=value ...] [--out DIR] [--steps N] "
         "[--resume [latest|auto|STEP|PATH]] [--replicate R] [--sp P] [--help]\n"
         "       python -m fvx.run EXPERIMENT.py [a.b.c=value ...] --dry-run [--world N] [--replicate R] [--video FxHxW]\n"
         "       python -m fvx.run replay RUN_DIR --step N [--experiment FILE]\n"
         "       python -m fvx.run export RUN_DIR --out FOLDER [--step N] [--role ROLE] [--ema] [--lora] [--format F]\n"
         "                                [--dtype D]\n"
         "       python -m fvx.run preprocess EXPERIMENT.py[:recipe] --videos DIR --out DATASET [a.b.c=value ...]\n"
         "       python -m fvx.run encode-prompts EXPERIMENT.py[:recipe] PROMPTS.txt --out FILE.safetensors "
         "[a.b.c=value ...]\n"
         "       python -m fvx.run sample RUN_DIR|EXPORT (--prompt TEXT ... | --prompts FILE) [--out DIR] [options]")
BAD_INPUT = (fconfig.ConfigError, ValueError, FileNotFoundError)
AUTO = "auto"  # --resume auto


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fvx.run", usage=USAGE, add_help=False,
                                     description="Train with an fvx experiment file.")
    parser.add_argument("experiment", nargs="?", help="a Python file that assigns `config`")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. method.optim.lr=1e-5")
    parser.add_argument("--out", help="the run folder (shortcut for run.output_dir=DIR)")
    parser.add_argument("--steps", type=int, help="the number of steps (shortcut for run.steps=N)")
    parser.add_argument("--resume", nargs="?", const="latest",
                        help="resume from the run folder's newest checkpoint, from checkpoint STEP, or from PATH; "
                             "'auto': resume when the run folder has a checkpoint, else start (one command for a "
                             "requeued job)")
    parser.add_argument("--dry-run", action="store_true", help="print the memory estimate per rank and exit")
    parser.add_argument("--world", type=int, help="--dry-run: the number of ranks (default: this launch's)")
    parser.add_argument("--video", help="--dry-run: FRAMESxHEIGHTxWIDTH in pixels (default: the experiment's data)")
    parser.add_argument("--device-memory", type=float, help="--dry-run: GiB per device (default: an H200's)")
    parser.add_argument("--replicate", type=int, default=1, help="HSDP replica groups (params shard over the rest)")
    parser.add_argument("--sp", type=int, default=1,
                        help="sequence parallelism: groups of SP ranks share samples and split their tokens")
    parser.add_argument("-h", "--help", action="store_true", help="list the experiment's config fields and exit")
    args = parser.parse_intermixed_args(argv)
    if args.resume is not None and "=" in args.resume and not os.path.exists(args.resume):
        args.overrides.append(args.resume)  # `--resume a.b=1`: a bare --resume followed by an override
        args.resume = "latest"
    args.print_usage = parser.print_help
    return args


def overrides_of(args: argparse.Namespace) -> list[str]:
    """The overrides, then ``--out`` and ``--steps`` as overrides, in the order they apply."""
    overrides = list(args.overrides)
    for flag, value, field in (("--out", args.out, "run.output_dir"), ("--steps", args.steps, "run.steps")):
        if value is None:
            continue
        given = [item for item in overrides if item.partition("=")[0].strip() == field]
        if given:
            raise fconfig.ConfigError(f"{flag} {value} and {given[0]} both set {field}: give one")
        overrides.append(f"{field}={value}")
    return overrides


def resolve_config(args: argparse.Namespace) -> fconfig.Config:
    """The experiment's config with the overrides, then ``--out`` and ``--steps``, applied and validated."""
    return experiment.load_config(args.experiment, overrides_of(args))


def print_fields(config: fconfig.Config, experiment_file: str) -> None:
    """``--help``: every field with its value and type. A reader that stops early (``| head``) is no error."""
    rows = fconfig.describe(config)
    width = max(len(path) for path, _, _ in rows)
    try:
        print(f"usage: {USAGE}\n\nfields of {experiment_file} (override any with field=value):")
        for path, type_name, value in rows:
            print(f"  {path:<{width}}  {value!r}  ({type_name})")
        sys.stdout.flush()
    except BrokenPipeError:  # Python's recipe: send what is left to devnull, so the exit's flush raises nothing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _warn(config: fconfig.Config) -> None:
    """The config's legal contradictions (fvx.training.config_checks.config_warnings), one line each on stderr."""
    for line in config_checks.config_warnings(config):
        print(f"warning: {line}", file=sys.stderr)


def _error(error: BaseException, rank: int = 0) -> int:
    """Bad input: one line on stderr (rank 0's), exit status 2. Under torchrun each rank also leaves the line in its
    error file, which torchrun's failure summary shows as the root cause instead of a traceback hint."""
    line = f"fvx.run: error: {error}"
    if rank == 0:
        print(line, file=sys.stderr)
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        record = {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}
        pathlib.Path(os.environ["TORCHELASTIC_ERROR_FILE"]).write_text(json.dumps({"message": record}))
    return 2


def train_main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    if args.experiment is None:
        args.print_usage()
        return 0 if args.help else 2
    try:
        config = resolve_config(args)
        if args.help:
            print_fields(config, args.experiment)
            return 0
        if int(os.environ.get("RANK", "0")) == 0:
            for line in fconfig.repeated(overrides_of(args)):
                print(f"note: {line}", file=sys.stderr)
        if args.dry_run:
            if args.resume is not None:
                raise ValueError("--dry-run estimates a run before it starts from its config; it takes no --resume "
                                 "(drop --resume: the config and the memory are the same)")
            world = args.world if args.world is not None else int(os.environ.get("WORLD_SIZE", "1"))
            video = None if args.video is None else dry_run.parse_video(args.video)
            table = dry_run.report(config, world=world, video=video, replicate=args.replicate,
                                   sp=args.sp, device_memory_gib=args.device_memory)
            _warn(config)
            print(table)
            return 0
        d = processes.init_distributed()
        jax_started = processes.init_jax_distributed(d)  # orbax's primary process for sharded checkpoints
    except BAD_INPUT as error:
        return _error(error)
    try:
        return train_here(args, config, d)
    finally:
        if jax_started:
            import jax

            jax.distributed.shutdown()
        if d.backend is not None:
            torch.distributed.destroy_process_group()


def train_here(args: argparse.Namespace, config: fconfig.Config, d: processes.Dist) -> int:
    """Train on this process's part of the launch (``d``): rank 0 prints and writes."""
    say = print if d.rank == 0 else (lambda *a, **k: None)
    try:
        if args.sp != 1 and (args.sp < 1 or d.world % args.sp):
            raise ValueError(f"--sp {args.sp} must divide the number of processes, {d.world} here (launch with "
                             f"torchrun --nproc_per_node a multiple of {args.sp}, or choose --sp among "
                             f"{', '.join(map(str, sequence_parallel.divisors(d.world)))})")
        mesh = processes.make_mesh(args.replicate, sp=args.sp) if d.world > 1 else None
        if args.resume == AUTO:  # a requeue: continue when there is a checkpoint, else start
            args.resume = "latest" if resume.has_checkpoints(pathlib.Path(config.run.output_dir)) else None
        if args.resume is not None:  # the run's own config, with what this launch overrides on top
            config, _ = resume.resumed_config(config, overrides_of(args), args.resume)
        prepared = experiment.prepare(config, resume_from=args.resume, rank=d.rank, world=d.world, mesh=mesh)
        launch = run_folder.Launch(experiment=str(pathlib.Path(args.experiment).absolute()),
                             overrides=tuple(overrides_of(args)))
    except BAD_INPUT as error:
        return _error(error, d.rank)
    if d.rank == 0:
        _warn(config)
    if args.replicate != 1 and d.world == 1:
        say(f"note: --replicate {args.replicate} has no effect in a single process (it groups the ranks of a "
            "torchrun launch)", file=sys.stderr)
    say(banner(args.experiment, config, prepared, d.world, args.sp))
    if prepared.resumed_from is not None:
        say(f"resuming from {prepared.resumed_from} (step {int(prepared.state.step)}) with the config saved there"
            + ("" if prepared.config_changes else ", unchanged"))
        for change in prepared.config_changes:
            say(f"note: this launch changes {change}", file=sys.stderr)
    start, first = time.perf_counter(), int(prepared.state.step)
    try:
        loop.train(config, prepared, launch=launch, rank=d.rank, world=d.world)
    except loop.NonFiniteError as error:
        say(f"fvx.run: {error}", file=sys.stderr)
        return 1
    except Interrupted as stopped:
        again = f"python -m fvx.run {shlex.quote(args.experiment)} --out {shlex.quote(config.run.output_dir)} --resume"
        saved = "saved" if config.run.checkpoint.every or config.run.checkpoint.final else "NOT saved (checkpoints off)"
        say(f"fvx.run: interrupted at step {stopped.step} ({signal.Signals(stopped.signum).name}; a checkpoint of it "
            f"is {saved}); resume with: {again}", file=sys.stderr)
        return 128 + stopped.signum
    except checkpoint.CheckpointWriteError as error:  # a full disk, an I/O error
        again = f"python -m fvx.run {shlex.quote(args.experiment)} --out {shlex.quote(config.run.output_dir)} --resume"
        say(f"fvx.run: the run stopped: {error}; free space, then resume with: {again}", file=sys.stderr)
        return 1
    except parquet.DataError as error:  # a bad sample met mid-run: the data, not the program
        say(f"fvx.run: the run stopped: {error} (checkpoints saved before are intact; fix or drop the sample and "
            "continue with --resume)", file=sys.stderr)
        return 1
    except run_lock.RunLockError as error:  # another run took the folder since this one checked it
        return _error(error, d.rank)
    except fcallbacks.CallbackError as error:
        say(f"fvx.run: the run stopped: {error} (checkpoints saved before it are intact; continue with --resume)",
            file=sys.stderr)
        return 1
    steps = max(config.run.steps - first, 0)
    skipped = _skips(config) if config.run.on_nonfinite == "skip" else 0
    say(f"done: {steps} steps in {time.perf_counter() - start:.1f} s; run folder {config.run.output_dir}"
        + (f" ({d.world} processes)" if d.world > 1 else "")
        + (f"; {skipped} non-finite step(s) skipped in all" if skipped else ""))
    stats = loop.compile_stats(prepared.setup)
    if stats is not None:
        say(f"compiled: {stats.graphs} graph(s), {stats.recompiles} recompile(s)")
    return 0


def _skips(config: fconfig.Config) -> int:
    """The run's non-finite steps skipped so far (its last logged ``nonfinite_skips``)."""
    logged = tracking.read_scalars(pathlib.Path(config.run.output_dir) / run_folder.TENSORBOARD).get(
        "nonfinite_skips")
    return int(logged[-1][1]) if logged else 0


def banner(experiment_file: str, config: fconfig.Config, prepared: experiment.Prepared, world: int,
           sp: int = 1) -> str:
    """What this launch is about to do, in a line or two: experiment, run folder, ranks, models and steps."""
    state, models = prepared.state, prepared.setup.models
    sizes = {}
    for role_name, model in models.items():
        sizes.setdefault(model.name, []).append(role_name)
    described = "; ".join(f"{name} ({', '.join(roles)})" for name, roles in sizes.items())
    trained = sum(p.numel() for role_state in state.roles.values() if role_state.opt_state is not None
                  for p in role_state.params.values())  # an old policy's copy is not trained
    start = int(state.step)
    steps = (f"steps {start}..{config.run.steps}" if start else f"{config.run.steps} steps")
    ranks = f"{world} process{'es' if world > 1 else ''}" + (f", sequence parallel over {sp}" if sp > 1 else "")
    return (f"fvx: {experiment_file} -> {config.run.output_dir} ({ranks}); "
            f"models: {described}; {trained / 1e6:.2f}M trained params on this rank; {steps}, batch "
            f"{config.data.batch_size}")


def replay_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m fvx.run replay", description=(
        "Recompute step N of a run from the newest checkpoint at or before it, and compare its metrics with the "
        "logged ones (exit status 1 on any difference, or when the step was never logged)."))
    parser.add_argument("run_dir", help="the run folder")
    parser.add_argument("--step", type=int, required=True, help="the step to replay (0-based, as logged)")
    parser.add_argument("--experiment", help="the experiment file whose own classes (and their code) to use; the "
                                             "run folder alone is read as data, never run")
    args = parser.parse_args(argv)
    try:
        result = replay.replay(args.run_dir, args.step, progress=sys.stderr.isatty(), experiment=args.experiment)
    except BAD_INPUT as error:
        return _error(error)
    rows = replay.compare(result.metrics, replay.logged_metrics(args.run_dir, args.step), replay.tolerance_for(result))
    print(replay.report(result, rows, args.run_dir))
    logged = any(row.logged is not None for row in rows)
    return 0 if logged and all(row.same for row in rows) else 1


def export_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m fvx.run export", description=(
        "Write a trained role of a run as a diffusers folder (transformer/ loadable by from_pretrained), in the "
        "original layout ComfyUI loads, or a LoRA role's adapters as PEFT, ComfyUI or musubi-tuner files."))
    parser.add_argument("run_dir", help="the run folder")
    parser.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    parser.add_argument("--step", type=int, help="the checkpoint to export (default: the newest)")
    parser.add_argument("--role", help="the trained role to export (default: the run's only one, or the student)")
    parser.add_argument("--ema", action="store_true", help="export the role's EMA params")
    parser.add_argument("--base", help="a diffusers pipeline folder of the base model: its other components (VAE, "
                                       "text encoder, tokenizer) are linked in, so the folder loads as a pipeline")
    parser.add_argument("--lora", action="store_true", help="export a LoRA role's adapters (without it, a LoRA role "
                                                            "exports with its adapters merged into the weights)")
    parser.add_argument("--format", help=(
        "whole weights: diffusers (the default; a pipeline folder) or comfyui (RUN.safetensors, RUN the run folder's "
        "name, RUN_ema with --ema, in the model's original layout, for ComfyUI's Load Diffusion Model and "
        "musubi-tuner's --dit; Wan families; Wan 2.2 A14B: RUN_high_noise and RUN_low_noise); with --lora: peft (the "
        "default; "
        "pytorch_lora_weights.safetensors for diffusers' load_lora_weights; ComfyUI and musubi-tuner ignore its keys), "
        "comfyui (RUN_lora_comfyui.safetensors: lora_down/lora_up/alpha under the original module names, for "
        "ComfyUI's LoraLoaderModelOnly) or musubi (RUN_lora_musubi.safetensors: lora_unet_ keys, for musubi-tuner's "
        "--lora_weight)"))
    parser.add_argument("--dtype", help="whole weights: write every param in fp32 or bf16 (default: the trained "
                                        "params as trained, fp32; a LoRA's merged base as the base folder stores it)")
    args = parser.parse_args(argv)
    try:
        done = export.export(args.run_dir, args.out, step=args.step, role=args.role, ema=args.ema, base=args.base,
                             adapters=args.lora, form=args.format, dtype=args.dtype)
    except BAD_INPUT as error:
        return _error(error)
    what = ("EMA " if done.ema else "") + ("adapters" if args.lora else "params")
    what += " (its adapters merged into the base)" if done.merged else ""
    names = ", ".join(path.name for path in done.files.values())
    stored = "" if args.lora else f" in {' and '.join(done.dtypes)}"
    if args.lora or args.format == "comfyui":
        print(f"exported the {what} of role {done.role!r} at step {done.step} to {done.folder}{stored}: {names}")
        for line in done.how_to_load:
            print(f"load: {line}")
    else:
        print(f"exported the {what} of role {done.role!r} at step {done.step} to {done.folder}{stored} "
              f"({names}, model_index.json, scheduler/)")
        _print_pipeline_note(done.folder, args.base)
    if done.sampling is not None:
        print(f"sample it as trained: {json.dumps(done.sampling)} (recorded in {export.MANIFEST})")
    return 0


def _print_pipeline_note(folder: pathlib.Path, base: str | None) -> None:
    """How the exported diffusers folder loads as a pipeline: linked to ``base``, or with the components it lacks."""
    missing = export.missing_components(folder)
    if base is not None:
        print(f"linked from {base}: the other components; DiffusionPipeline.from_pretrained({str(folder)!r}) loads the "
              "whole pipeline")
    elif missing:
        print(f"note: fvx trains transformers only: {', '.join(missing)} are not in it; load it with "
              f"from_pretrained({str(folder)!r}, " + ", ".join(f"{m}=None" for m in missing)
              + ") or pass them, or export again with --base /path/to/the/base/pipeline")


def preprocess_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m fvx.run preprocess", description=(
        "Encode a folder of videos (or images) and captions into FastVideo's parquet with the experiment's model: its "
        "VAE and text encoder(s) from models.student.path (the toy world's codec for the CPU defaults). Inputs: "
        "videos/ beside videos2caption.json (FastVideo's layout), or media files each beside a caption file of the "
        "same name (clip.mp4 + clip.txt). The clip geometry is data.preprocess.* (override it like any field). Under "
        "torchrun each rank encodes its own parts; a run started again continues where it stopped. Train on it with "
        "data.path=DATASET/combined_parquet_dataset. For data.kind=text_only, --videos is a prompts file: text, one "
        "a line, or FastVideo's validation JSON ({\"data\": [{\"caption\": ...}]})."))
    parser.add_argument("experiment", help="the experiment file (FILE.py or FILE.py:recipe)")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. data.preprocess.num_frames=33")
    parser.add_argument("--videos", required=True, help="the input folder (data.kind=text_only: a prompts file)")
    parser.add_argument("--out", required=True, help="the dataset folder to write (or to continue)")
    args = parser.parse_intermixed_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        config = experiment.load_config(args.experiment, args.overrides)
        done = preprocessing.run_preprocess(config, args.videos, args.out, progress=True)
    except BAD_INPUT as error:
        return _error(error, rank)
    data = pathlib.Path(args.out) / "combined_parquet_dataset"
    rows = "sections" if config.data.kind == "framepack" else "clips"  # a row a section of a clip
    if done.get("already"):
        print(f"{args.out} is already complete: {done['rows']} {rows} ({len(done['skipped'])} skipped); train on it "
              f"with data.path={data}")
        return 0
    if done["rows"] is None:
        print(f"rank {rank}: its parts are done; the last rank to finish completes {args.out}")
        return 0
    if not done["rows"]:
        return _error(ValueError(f"no input could be encoded ({len(done['skipped'])} skipped, listed in "
                                 f"{pathlib.Path(args.out) / 'skipped.json'})"), rank)
    print(f"wrote {done['rows']} {rows} to {data} ({len(done['skipped'])} skipped"
          + (f", listed in {pathlib.Path(args.out) / 'skipped.json'}" if done["skipped"] else "")
          + f"); train on it with data.path={data}"
          + (" data.batch_by_shape=true" if config.data.preprocess.buckets else ""))
    return 0


def encode_prompts_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m fvx.run encode-prompts", description=(
        "Encode prompts with the experiment's text encoder into a cond file: validation prompts "
        "(validation.prompts_file) or a negative prompt (validation.negative_prompt_path, "
        "method.negative_prompt_path)."))
    parser.add_argument("experiment", help="the experiment file (FILE.py or FILE.py:recipe)")
    parser.add_argument("prompts", help="a text file, one prompt a line, or FastVideo's validation JSON (.json: "
                        "{\"data\": [{\"caption\": ...}]})")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. models.student.path=/models/x")
    parser.add_argument("--out", required=True, help="the cond file to write (.safetensors)")
    parser.add_argument("--negative", action="store_true", help="negative prompts: a family whose text states the "
                        "clip (Cosmos 3's duration and resolution sentences, for the clip data.preprocess cuts) states "
                        "its inverse, as its pipeline writes a negative prompt")
    args = parser.parse_intermixed_args(argv)
    try:
        config = experiment.load_config(args.experiment, args.overrides)
        count, path = preprocessing.run_encode_prompts(config, args.prompts, args.out, args.negative)
    except BAD_INPUT as error:
        return _error(error)
    print(f"wrote {count} prompt{'s' if count != 1 else ''} to {path}")
    return 0


def sample_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m fvx.run sample", description=(
        "Make videos from prompts with a trained model: a run folder's role (its newest checkpoint, or --step) or an "
        "exported folder, sampled as the run validates it (a fine-tuned model's guided many-step ODE, a DMD2 "
        "student's few steps, a flow map's jumps, a causal student streamed block by block for any --frames). "
        "Writes <prompt>_<seed>.mp4 per video (and .gif with --gif) and samples.json, which records how to make each "
        "again. Under torchrun each rank makes its share of the videos into one folder."))
    parser.add_argument("source", help="a run folder, or a folder `export` wrote")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the run's config, e.g. "
                                                     "models.student.local_attn_size=6 (a streaming model's window)")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    parser.add_argument("--prompts", help="a text file, one prompt a line, or FastVideo's validation JSON (.json)")
    parser.add_argument("--out", help="the folder to write (default: samples/<source>_step<N>)")
    parser.add_argument("--step", type=int, help="a run folder's checkpoint (default: the newest)")
    parser.add_argument("--role", help="a run folder's trained role (default: its only one, or the student)")
    parser.add_argument("--ema", action="store_true", help="sample the role's EMA params")
    parser.add_argument("--base", help="a diffusers pipeline folder of the base model whose text encoder and VAE to "
                                       "use (default: the model's own folder)")
    parser.add_argument("--seed", type=int, default=0, help="video i gets seed SEED + i (default 0)")
    parser.add_argument("--num-per-prompt", type=int, default=1, help="videos per prompt (default 1)")
    parser.add_argument("--batch-size", type=int, default=1, help="videos sampled together (default 1)")
    parser.add_argument("--frames", type=int, help="frames per video (default: the run's validation clips)")
    parser.add_argument("--height", type=int, help="height in pixels (default: the run's)")
    parser.add_argument("--width", type=int, help="width in pixels (default: the run's)")
    parser.add_argument("--steps", type=int, help="many-step samplers: the number of steps (default: the run's "
                                                   "validation.num_steps)")
    parser.add_argument("--guidance", type=float, help="classifier-free guidance scale of guided samplers (default: "
                                                       "the run's validation.guidance_scale)")
    parser.add_argument("--shift", type=float, help="the schedule's shift (default: validation.flow_shift)")
    parser.add_argument("--schedule", choices=sampling.SCHEDULES, help="many-step levels: fvx (FastVideo's evenly "
                        "spaced, shifted), diffusers (FlowMatchEulerDiscreteScheduler's, as its pipelines sample) or "
                        "model (the family's own pipeline's: CogVideoX's DDIM)")
    parser.add_argument("--solver", choices=sampling.SOLVERS, help="many-step samplers: euler (default) or unipc "
                        "(UniPCMultistepScheduler's flow configuration, which Wan's and Cosmos' folders ship)")
    parser.add_argument("--karras", help="with --solver unipc: SIGMA_MIN,SIGMA_MAX, UniPC on Karras' levels "
                                         "(Cosmos 2.5's released scheduler: 0.01,200)")
    parser.add_argument("--shift-terminal", type=float, help="stretch the levels to end at this one (LTX-Video's "
                                                             "schedulers: 0.1 for 0.9.0/0.9.1)")
    parser.add_argument("--negative-prompt", help="the unconditional prompt of guided sampling (default: the run's "
                                                  "validation.cfg_uncond)")
    parser.add_argument("--jumps", type=int, help="a flow-map student: the number of jumps")
    parser.add_argument("--image", help="image-to-video: the first frame; a Wan-Animate model: the character")
    parser.add_argument("--last-image", help="FramePack (inverted anti-drifting sections), with --image: the frame "
                                             "to end on (the first section made sees it after itself, its image "
                                             "features averaged with --image's)")
    parser.add_argument("--video", help="Helios (chunks): a video to continue, its last whole chunks (--frames: the "
                                        "frames made after them); a video-to-video model (Cosmos 3 with "
                                        "given_frames): the video whose first latent frames the made one keeps")
    parser.add_argument("--actions", help="a Matrix-Game model (data.kind=matrixgame2): its actions, one row per video "
                                          "frame, as preprocess reads them (.npz of keyboard [F, K] and mouse [F, 2], "
                                          "or .npy of the keyboard); the video is named after the file")
    parser.add_argument("--control", help="a VACE model (data.kind=vace): the control video (depth, pose, a masked "
                                          "source...), its first frames as many as the video's")
    parser.add_argument("--mask", help="with --control or --background: a mask video, white where to make the video "
                                       "(default: all)")
    parser.add_argument("--reference", help="with --control: a reference image (its latent frame goes in front and "
                                            "is dropped)")
    parser.add_argument("--pose", help="a Wan-Animate model (data.kind=animate): the pose video, its first frames as "
                                       "many as the video's")
    parser.add_argument("--face", help="with --pose: the face video (face crops, one per frame; resized to the size "
                                       "the model reads)")
    parser.add_argument("--background", help="with --pose: the replace mode's background video, the character put "
                                             "where --mask is white")
    parser.add_argument("--gif", action="store_true", help="also write a GIF of each video")
    parser.add_argument("--scale", type=int, default=1, help="enlarge the written videos N times (nearest)")
    parser.add_argument("--fps", type=float, help="frames per second of the files (default: validation.fps)")
    args = parser.parse_intermixed_args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    try:
        if args.prompt and args.prompts:
            raise ValueError("give --prompt or --prompts, not both")
        prompts = tuple(args.prompt) if args.prompt else (
            sampling.read_prompts_file(args.prompts) if args.prompts else ())
        if any(not prompt.strip() for prompt in prompts):
            raise ValueError("--prompt is empty")
        request = sampling.Request(
            args.source, prompts, tuple(args.overrides), out=args.out, step=args.step, role=args.role, ema=args.ema,
            base=args.base, seed=args.seed, num_per_prompt=args.num_per_prompt, batch_size=args.batch_size,
            frames=args.frames, height=args.height, width=args.width, steps=args.steps, guidance=args.guidance,
            shift=args.shift, schedule=args.schedule, shift_terminal=args.shift_terminal, solver=args.solver,
            karras=None if args.karras is None else _karras(args.karras),
            negative_prompt=args.negative_prompt, jumps=args.jumps, image=args.image, last_image=args.last_image,
            video=args.video, actions=args.actions, control=args.control, mask=args.mask, reference=args.reference,
            pose=args.pose, face=args.face, background=args.background, gif=args.gif, scale=args.scale, fps=args.fps)
        done = sampling.run_sample(request, rank=rank, world=world, progress=sys.stderr.isatty(),
                                   say=lambda line: print(line, file=sys.stderr))
    except BAD_INPUT as error:
        return _error(error, rank)
    for video in done["videos"]:
        score = {name: value for name, value in video.get("world_score", {}).items() if "/" not in name}
        print(f"{video['files'][0]}: {video['prompt']!r}, seed {video['seed']}"
              + ("" if not score else ", the toy world's score: "
                 + ", ".join(f"{name} {value:.3g}" for name, value in score.items())))
    count = len(done["videos"])
    print(f"{count} video{'s' if count != 1 else ''} from {done['where']} (its {done['sampler']!r} sampler) in "
          f"{done['folder']}; how each was made: {done['folder'] / sampling.SAMPLES}")
    return 0


def _karras(text: str) -> tuple[float, float]:
    """``--karras SIGMA_MIN,SIGMA_MAX``; a ValueError naming the flag."""
    try:
        low, high = (float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--karras takes SIGMA_MIN,SIGMA_MAX (e.g. 0.01,200), got {text!r}") from None
    return low, high


COMMANDS = {"replay": replay_main, "export": export_main, "preprocess": preprocess_main,
            "encode-prompts": encode_prompts_main, "sample": sample_main}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main())
