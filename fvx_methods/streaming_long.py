"""Streaming long tuning (FastVideo's StreamingLongTuningMethod, spec §2.8; LongLive's recipe): a block-causal student
distilled as Self-Forcing is (``fvx_methods.self_forcing``), but on a stream that runs past the clip length it was
trained on, one chunk of latent frames per step.

The run follows a multi-phase schedule (``fvx_methods.library.distill_schedule``): a non-streaming stage is a
Self-Forcing step on the batch cut to the stage's ``num_latent_t`` frames; a streaming stage carries a stream across
steps (the state's ``carry``: the stream's cond, its last chunk's latents, its KV cache, its length), which a step
extends by one chunk::

    a new stream (from this step's batch) when none is open, the stage changed, or it reached its max length
    new, overlap = the chunk plan (:func:`chunk_plan`: the first chunk ``min(chunk, remaining)``; then ``chunk -
                   fixed_overlap``, or a draw from ``range(min_new, max_new, chunk_size)``)
    pred  = the student's new frames, block by block on the carried cache at their absolute frame positions (the
            Self-Forcing rollout's exits and hops, no start_gradient_frame; every block's keys and values written
            after a pass over it re-noised to context_noise, even at 0: the grid's smallest level)
    full  = [overlap frames of the last chunk | pred], its first frame re-encoded (decode, take the last pixel
            frame, encode: the anchor) when ``streaming_reencode_overlap_anchor``; mask = 1 on pred's frames
    L_gen = masked_mean(0.5 (full - sg(full - grad))^2),  grad_b = nan_to_num((x0_fake - x0_real)_b /
            max(mean|full_b - x0_real_b|, 1e-6))   (the teacher's and critic's x0 of ``full`` noised; student steps)
    L_crit = masked_mean((v_critic(full_t, t) - (eps - sg(full)))^2)   on the same chunk (every step)

``masked_mean(V, m) = sum(V m) / max(sum m, 1)`` over every element. The student's gradients reach it only through
pred's exit calls: they are taken block at a time (``self_forcing.exit_grads``, from the carried cache), so one
block's graph is alive whatever the stream's length. Score timesteps are Self-Forcing's, clamped to
``[round(1000 min_timestep_ratio), round(1000 max_timestep_ratio)]`` when either is set.

Draws: ``split(fold_in(run_key, step), 4)`` gives the chunk length, the rollout, the DMD scores and the critic's;
FastVideo draws the chunk length on rank 0 and broadcasts it, fvx from the step key (the same on every rank). The
carry is per sample (each rank holds its samples' rows) and is checkpointed with the step: a run resumed inside a
stream continues it bit for bit, and replay steps forward from the newest checkpoint before a step.

Where fvx differs on purpose: chunks are whole blocks of ``chunk_size`` (the causal Wan refuses a short block, as
FastVideo's causal sampler does), so a schedule whose chunk arithmetic leaves a short block is refused before the run,
whatever ``streaming_require_full_blocks`` says; a stream's chunk is rolled once for the whole batch
(``grad_accum`` 1).
"""
from __future__ import annotations

import functools
from typing import Annotated, Any, Callable, Mapping

import msgspec
import torch

from fvx.core import flow, random, role
from fvx.core.state import Batch, Metrics, NONFINITE, Program, TrainState
from fvx.distributed import sharding
from fvx_methods import self_forcing as sf
from fvx_methods.library import distill_schedule as schedule, distribution_matching as dm
from fvx_models import block_causal as bc
from fvx_models.model import Cond, Model, Params

STUDENT, CRITIC, TEACHER = dm.STUDENT, dm.CRITIC, dm.TEACHER
ROWS, AT = "rows", "at"  # the carry: per-sample rows (Shards along dim 0), and where the stream is


# --------------------------------------------------------------------------------------------------- the stream


def chunk_plan(length: int, previous_frames: int, stage: schedule.Stage, config: StreamingLong,
               key: torch.Tensor) -> tuple[int, int]:
    """``(new frames, overlap frames)`` of the next chunk of a stream ``length`` frames long whose last chunk kept
    ``previous_frames`` (module docstring); a random length is one draw of ``key``."""
    chunk, remaining = stage_chunk(stage, config), schedule.max_length(stage) - length
    if length == 0:
        return min(chunk, remaining), 0
    fixed = first_set(stage.fixed_overlap, config.streaming_fixed_overlap_latents)
    if fixed is not None:
        new = min(chunk - fixed, remaining)
    else:
        min_new = max(1, first_set(stage.min_new_frame, config.streaming_min_new_frame, chunk))
        max_new = min(chunk, remaining)
        choices = list(range(min_new, max_new, config.chunk_size)) or [max_new]
        new = max_new if max_new <= min_new else choices[int(random.randint(key, (), 0, len(choices)))]
    return new, min(chunk - new, previous_frames)


def first_set(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


def stage_chunk(stage: schedule.Stage, config: StreamingLong) -> int:
    """A streaming stage's chunk: its own, else ``streaming_chunk_size``, else the rollout block ``chunk_size``."""
    return schedule.chunk_size(stage, config.streaming_chunk_size or config.chunk_size)


def chunk_rollout(params: Params, stream: Batch, key: torch.Tensor, new: int, cache: Any, *, model: Model,
                  config: StreamingLong) -> tuple[sf.Rolled, Any]:
    """The stream's next ``new`` frames (no grad), block by block on ``cache`` (the stream's; positions continue
    from its next frame), and the cache with every block written: ``(rolled, cache)``."""
    exit_key, noise_key, hop_key, context_key = random.split(key, 4)
    index, cond, size = stream["sample_index"], stream["cond"], config.chunk_size
    steps, sigmas, model_t = sf.student_steps(config, index.device)
    c, _, h, w = stream["shape"]
    noise = dm.per_sample_normal(noise_key, index, 0, (c, new, h, w), index.device)
    out, exits, ks = [], [], sf.exit_steps(exit_key, new // size, config)
    with torch.no_grad():
        for b, k in enumerate(ks):
            start = b * size
            x = sf.hop_to_exit(model, params, noise[:, :, start:start + size], k, cond, cache,
                               random.fold_in(hop_key, b), index, config)
            exits.append(sf.Exit((start, start + size), x, model_t[k].expand(len(index)), sigmas[k], graded=True))
            out.append(sf.exit_x0(model, params, exits[-1], cond, cache))
            cache = sf.write_context(model, params, out[-1], cache, cond, random.fold_in(context_key, b), index,
                                     config, always_noise=True)
    timesteps = steps[ks].mean().expand(len(index))
    return sf.Rolled(torch.cat(out, dim=2), timesteps, tuple(exits), context_key), cache


def with_overlap(previous: torch.Tensor, pred: torch.Tensor, overlap: int, chunk: int, config: StreamingLong,
                 codec: Callable[[], Any], latents: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(full [B, C, P, H, W], mask [1, 1, P, 1, 1])``: the chunk the losses see, ``pred`` after the last chunk's
    ``overlap`` frames (``previous``: that chunk), the first frame re-encoded when ``streaming_reencode_overlap_anchor``
    (:func:`anchored`); the mask is 1 on ``pred``'s frames."""
    if overlap == 0:
        full = pred
    elif config.streaming_reencode_overlap_anchor:
        full = anchored(torch.cat([previous, pred], dim=2), chunk, config.streaming_anchor_inject_k, codec(), latents)
    else:
        full = torch.cat([previous[:, :, previous.shape[2] - overlap:], pred], dim=2)
    mask = torch.zeros(1, 1, full.shape[2], 1, 1, device=pred.device)
    mask[:, :, full.shape[2] - pred.shape[2]:] = 1
    return full, mask


def anchored(frames: torch.Tensor, chunk: int, inject_k: int, codec: Any, latents: Any) -> torch.Tensor:
    """The last ``P = min(chunk, T)`` frames of ``frames [B, C, T, H, W]`` with the first re-encoded (no grad): for
    ``inject_k`` 1, the latent of the last pixel frame that decoding every frame before the last ``P - 1`` gives; for
    ``k > 1``, the window's first ``k`` frames decoded and encoded again. ``latents``: the model's latent space
    (the codec works in the VAE's own scale)."""
    total = frames.shape[2]
    process = min(chunk, total)
    if total <= 1 or process <= 1:
        return frames[:, :, total - process:]
    k = min(inject_k, process)
    with torch.no_grad():
        if k == 1:
            video = codec.decode(latents.denormalize(frames[:, :, :total - (process - 1)]))
            head = latents.normalize(codec.encode(video[:, :, -1:]).float())
            return torch.cat([head.to(frames.dtype), frames[:, :, total - (process - 1):]], dim=2)
        window = frames[:, :, total - process:]
        head = latents.normalize(codec.encode(codec.decode(latents.denormalize(window[:, :, :k]))).float())
        return torch.cat([head.to(frames.dtype), window[:, :, k:]], dim=2)


def windowed(stream: Batch, model: Model, start: int, full: torch.Tensor, reanchored: bool,
             codec: Callable[[], Any]) -> Batch:
    """The stream as the teacher and critic score its chunk ``full`` (absolute latent frames ``[start, start + P)``):
    the window's cond (``Model.window_cond``: its actions; for a re-anchored chunk, the image condition of its first
    frame, as FastVideo's long tuning re-anchors a world model on each window), or the stream's own cond when the
    model's does not depend on the frames."""
    if model.window_cond is None:
        return stream
    given = first_frame_condition(full, codec(), model.latents) if reanchored else None
    return {**stream, "cond": model.window_cond(stream["cond"], start, full.shape[2], given)}


def first_frame_condition(full: torch.Tensor, codec: Any, latents: Any) -> torch.Tensor:
    """An image-to-video model's condition latents ``[B, C, P, H, W]`` for a clip starting at ``full``'s first frame:
    that frame decoded, followed by mid-grey frames, encoded and normalised (how the data's first-frame latents are
    made)."""
    with torch.no_grad():
        frame = codec.decode(latents.denormalize(full[:, :, :1]))[:, :, -1:]  # [B, 3, 1, H, W] in [0, 1]
        grey = torch.full_like(frame, 0.5).expand(-1, -1, latents.vae_stride[0] * (full.shape[2] - 1), -1, -1)
        encoded = codec.encode(torch.cat([frame, grey], dim=2)).float()
    return latents.normalize(encoded).to(full.dtype)


# -------------------------------------------------------------------------------------------------- the carry


def empty_carry(batch: Batch, *, model: Model, config: StreamingLong, stages: tuple[schedule.Stage, ...],
                shards: int) -> dict[str, Any]:
    """The carry of no stream, of fixed shapes for ``batch``'s samples (the cache sized for the longest streaming
    stage, the previous chunk for the largest chunk); rows as ``Shards`` over ``shards`` ranks."""
    index, cond = batch["sample_index"], batch["cond"]
    c, _, h, w = dm.sample_shape(batch, config)
    streaming = [s for s in stages if s.streaming]
    frames = max(schedule.max_length(s) for s in streaming)
    chunk = max(stage_chunk(s, config) for s in streaming)
    cache = model.causal.allocated_cache(frames, (len(index), c, config.chunk_size, h, w), index.device)
    rows = {"sample_index": torch.zeros_like(index),
            "previous": torch.zeros(len(index), c, chunk, h, w, device=index.device),
            **{f"cond.{name}": torch.zeros_like(value) for name, value in cond.items()},
            **{f"cache.keys.{i}": k for i, k in enumerate(cache.keys)},
            **{f"cache.values.{i}": v for i, v in enumerate(cache.values)}}
    at = {name: torch.zeros((), dtype=torch.int64) for name in ("length", "previous_frames", "next_frame")}
    at["stage"] = torch.full((), -1, dtype=torch.int64)
    at["slots"] = torch.tensor(cache.slots, dtype=torch.int64)
    return {ROWS: sharding.per_sample(rows, shards), AT: at}


def started(carry: dict[str, Any], batch: Batch, stage_index: int) -> dict[str, Any]:
    """``carry`` with a new stream of ``batch``'s samples: no frames yet, an empty cache."""
    rows = carry[ROWS]
    fresh = {"sample_index": batch["sample_index"].to(rows["sample_index"].dtype),
             "previous": torch.zeros_like(rows["previous"]),
             **{f"cond.{name}": value for name, value in batch["cond"].items()}}
    fresh.update({name: torch.zeros_like(value) for name, value in rows.items() if name.startswith("cache.")})
    slots = len(carry[AT]["slots"])
    at = {**{name: torch.zeros_like(value) for name, value in carry[AT].items()},
          "stage": torch.tensor(stage_index, dtype=torch.int64), "slots": torch.full((slots,), -1, dtype=torch.int64)}
    return {ROWS: rows.__class__(fresh, rows.layout), AT: at}


def stream_of(carry: dict[str, Any], shape: tuple[int, ...]) -> Batch:
    """What the stream's chunks are generated for: its samples' cond and indices, and the latent shape."""
    rows = carry[ROWS]
    cond = {name[len("cond."):]: value for name, value in rows.items() if name.startswith("cond.")}
    return {"cond": cond, "sample_index": rows["sample_index"], "shape": shape}


def cache_of(carry: dict[str, Any]) -> bc.KVCache:
    """The stream's KV cache from the carry's tensors."""
    rows, at = carry[ROWS], carry[AT]
    layers = sum(name.startswith("cache.keys.") for name in rows)
    return bc.KVCache(tuple(rows[f"cache.keys.{i}"] for i in range(layers)),
                      tuple(rows[f"cache.values.{i}"] for i in range(layers)),
                      tuple(at["slots"].tolist()), int(at["next_frame"]))


def advanced(carry: dict[str, Any], full: torch.Tensor, new: int, cache: bc.KVCache) -> dict[str, Any]:
    """``carry`` after a chunk: ``new`` frames longer, ``full``'s last frames kept as the previous chunk, ``cache``."""
    rows, at = carry[ROWS], carry[AT]
    kept = min(full.shape[2], rows["previous"].shape[2])
    previous = torch.zeros_like(rows["previous"])
    previous[:, :, :kept] = full[:, :, full.shape[2] - kept:]
    fresh = {**rows, "previous": previous, **{f"cache.keys.{i}": k for i, k in enumerate(cache.keys)},
             **{f"cache.values.{i}": v for i, v in enumerate(cache.values)}}
    return {ROWS: rows.__class__(fresh, rows.layout),
            AT: {**at, "length": at["length"] + new, "previous_frames": torch.tensor(kept, dtype=torch.int64),
                 "next_frame": torch.tensor(cache.next_frame, dtype=torch.int64),
                 "slots": torch.tensor(cache.slots, dtype=torch.int64)}}


# --------------------------------------------------------------------------------------------------- the losses


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(values mask) / max(sum of mask broadcast to values, 1)``."""
    mask = mask.to(values.dtype).expand_as(values)
    return (values * mask).sum() / mask.sum().clamp_min(1)


def masked_dmd(full: torch.Tensor, mask: torch.Tensor, critic_params: Params, teacher_params: Params,
               stream: Batch, key: torch.Tensor, *, roles: dm.Roles, score: dm.Score,
               negative: Cond | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(L_gen, normaliser [B], d L_gen / d full)`` of the module docstring (no grad)."""
    x0_fake, x0_real, _ = dm.real_and_fake_x0(critic_params, teacher_params, full, stream, key, critic=roles.critic,
                                              teacher=roles.teacher, score=score, negative=negative)
    target, normalizer = dm.dmd_target(full, x0_fake, x0_real, score.normalizer_floor)
    residual = full.float() - target
    weights = mask.to(residual.dtype).expand_as(residual)
    return masked_mean(0.5 * residual ** 2, mask), normalizer, residual * weights / weights.sum().clamp_min(1)


def masked_critic_loss(critic_params: Params, chunk: Batch, key: torch.Tensor, *, critic: Model,
                       score: dm.Score) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``masked_mean((v(x_t, t) - (eps - x0))^2)`` of the critic on the chunk ``chunk["x0"]`` (no grad into it)
    under ``chunk["mask"]``; aux: ``score_timestep``."""
    x0 = chunk["x0"].detach()
    x_t, noise, t = dm.noised(x0, chunk["sample_index"], key, score, score.grid(x0.device))
    v = critic.apply(critic_params, x_t, t, chunk["cond"]).float()
    return masked_mean((v - flow.velocity_target(x0, noise)) ** 2, chunk["mask"]), {"score_timestep": t.mean()}


# --------------------------------------------------------------------------------------------------------- the step


def step_(state: TrainState, batch: Batch, *, roles: dm.Roles, config: StreamingLong, frozen: Mapping[str, Params],
          stages: tuple[schedule.Stage, ...], codec: Callable[[], Any], negative: Cond | None = None,
          before: role.BeforeUpdate | None = None) -> tuple[TrainState, Metrics]:
    """One step, donating ``state``: the stage of iteration ``step + 1``; a Self-Forcing step on the batch cut to
    its horizon, or the next chunk of the carried stream. Metrics: the distribution-matching step's,
    ``distill_stage_index``, and ``active_num_latent_t`` or ``streaming_current_length`` / ``streaming_max_length``
    / ``streaming_new_frames`` / ``streaming_overlap``."""
    index = schedule.select(stages, int(state.step) + 1)
    stage = stages[index]
    if not stage.streaming:
        short = cut(batch, stage.num_latent_t, config, roles.teacher)
        state, metrics = sf.step_(state._replace(carry=ended(state.carry)), short, roles=roles, config=config,
                                  frozen=frozen, negative=negative, before=before)
        return state, {**metrics, "distill_stage_index": torch.tensor(float(index)),
                       "active_num_latent_t": torch.tensor(float(stage.num_latent_t))}
    return stream_step_(state, batch, index, stage, roles=roles, config=config, frozen=frozen, codec=codec,
                        negative=negative, before=before)


def stream_step_(state: TrainState, batch: Batch, stage_index: int, stage: schedule.Stage, *, roles: dm.Roles,
                 config: StreamingLong, frozen: Mapping[str, Params], codec: Callable[[], Any],
                 negative: Cond | None, before: role.BeforeUpdate | None) -> tuple[TrainState, Metrics]:
    """A streaming stage's step: the next chunk of the carried stream (a new one when due), its masked DMD and
    critic losses, the critic's update every step and the student's on its cadence."""
    s, ranks, carry = int(state.step), roles.critic_opt.ranks, state.carry
    at = carry[AT]
    if int(at["stage"]) != stage_index or int(at["length"]) >= schedule.max_length(stage):
        carry = started(carry, batch, stage_index)
    length, kept = int(carry[AT]["length"]), int(carry[AT]["previous_frames"])
    plan_key, rollout_key, score_key, critic_key = random.split(random.fold_in(state.key, state.step), 4)
    new, overlap = chunk_plan(length, kept, stage, config, plan_key)
    stream, cache = stream_of(carry, dm.sample_shape(batch, config)), cache_of(carry)
    student, critic = state.roles[STUDENT], state.roles[CRITIC]
    student_base, critic_base, teacher = frozen.get(STUDENT), frozen.get(CRITIC), frozen[TEACHER]
    critic_params = role.with_trained(critic_base, critic.params)
    rolled, after = chunk_rollout(role.with_trained(student_base, student.params), stream, rollout_key, new, cache,
                                  model=roles.student, config=config)
    full, mask = with_overlap(carry[ROWS]["previous"][:, :, :kept], rolled.x0, overlap, stage_chunk(stage, config),
                              config, codec, roles.student.latents)
    scored = windowed(stream, roles.teacher, length + new - full.shape[2], full,
                      overlap > 0 and config.streaming_reencode_overlap_anchor, codec)
    updates = dm.update_student(s, config.generator_update_interval)
    metrics: Metrics = {"update_student": torch.tensor(float(updates)),
                        "distill_stage_index": torch.tensor(float(stage_index)),
                        "streaming_current_length": torch.tensor(float(length + new)),
                        "streaming_max_length": torch.tensor(float(schedule.max_length(stage))),
                        "streaming_new_frames": torch.tensor(float(new)),
                        "streaming_overlap": torch.tensor(float(overlap))}
    checked = []
    if updates:
        with torch.no_grad():
            loss, normalizer, d_full = masked_dmd(full, mask, critic_params, teacher, scored, score_key, roles=roles,
                                                  score=config.score(), negative=negative)
        grads = sf.exit_grads(student.params, student_base, rolled, stream, d_full[:, :, full.shape[2] - new:],
                              model=roles.student, config=config, cache=cache, always_noise=True)
        student_measured = role.measure(roles.student_opt, student, grads)
        metrics.update(generator_loss=ranks.mean(loss), dmd_normalizer=ranks.mean(normalizer.mean()),
                       **role.metrics(student_measured, STUDENT))
        checked += [metrics["generator_loss"], student_measured.norm]
    chunk = {**scored, "x0": full, "mask": mask}
    (loss, _), grads = role.grads(masked_critic_loss, critic_base, critic.params, chunk, 1, critic_key,
                                  critic=roles.critic, score=config.score())
    critic_measured = role.measure(roles.critic_opt, critic, grads)
    metrics.update(critic_loss=ranks.mean(loss), **role.metrics(critic_measured, CRITIC))
    state, metrics = dm.finish_(state, metrics, checked, roles=roles,
                                student_measured=student_measured if updates else None,
                                critic_measured=critic_measured, before=before)
    if NONFINITE in metrics:
        return state, metrics  # the stream does not advance either
    return state._replace(carry=advanced(carry, full, new, after)), metrics


def cut(batch: Batch, frames: int, config: StreamingLong, model: Model) -> Batch:
    """``batch`` whose samples are ``frames`` latent frames long (a non-streaming stage's horizon): its latents cut,
    or a stand-in of that shape for text-only data (the rollout reads only their shape), and its cond the window's
    (``Model.window_cond``: per-frame inputs such as actions cut too)."""
    if model.window_cond is not None:
        batch = {**batch, "cond": model.window_cond(batch["cond"], 0, frames, None)}
    if "latents" in batch:
        return {**batch, "latents": batch["latents"][:, :, :frames]}
    c, _, h, w = dm.sample_shape(batch, config)
    return {**batch, "latents": torch.zeros(()).expand(len(batch["sample_index"]), c, frames, h, w)}


def ended(carry: dict[str, Any]) -> dict[str, Any]:
    """``carry`` with no stream open (a non-streaming stage closes it)."""
    at = {**carry[AT], "stage": torch.full((), -1, dtype=torch.int64), "length": torch.zeros((), dtype=torch.int64)}
    return {**carry, AT: at}


# -------------------------------------------------------------------------------------------------------- the build


class StreamingLong(sf.SelfForcing, tag="streaming_long"):
    """Every knob of FastVideo's streaming long tuning (spec §2.8): Self-Forcing's (``sf.SelfForcing``; its
    ``chunk_size`` is the rollout block) and

    multi_phased_distill_schedule: the stages (``fvx_methods.library.distill_schedule``: a list of dicts, a string
        ``"end:num_latent_t,..."`` or empty for one streaming stage).
    streaming_chunk_size: latent frames per chunk (None: ``chunk_size``); streaming_max_length: a stream's length
        (None: the data's frames); streaming_min_new_frame: the fewest new frames a later chunk draws (None: the
        chunk); streaming_fixed_overlap_latents: a fixed overlap, ``0 <= x < chunk`` (None: drawn lengths).
    streaming_anchor_inject_k / streaming_reencode_overlap_anchor: how many leading frames of an overlapping chunk
        are re-encoded, and whether they are (needs the experiment's ``vae`` to encode).
    streaming_require_full_blocks: FastVideo's check that new frames are whole blocks; fvx always needs them.
    real_score_cfg: false scores with the teacher's conditional x0 alone (no guidance).
    min_timestep_ratio / max_timestep_ratio: the score timesteps' window, ``round(1000 ratio)``.
    """

    multi_phased_distill_schedule: str | list[dict[str, Any]] | None = None
    streaming_chunk_size: Annotated[int, msgspec.Meta(gt=0)] | None = None
    streaming_max_length: Annotated[int, msgspec.Meta(gt=0)] | None = None
    streaming_min_new_frame: Annotated[int, msgspec.Meta(ge=1)] | None = None
    streaming_fixed_overlap_latents: Annotated[int, msgspec.Meta(ge=0)] | None = None
    streaming_anchor_inject_k: Annotated[int, msgspec.Meta(ge=1)] = 1
    streaming_reencode_overlap_anchor: bool = True
    streaming_require_full_blocks: bool = False
    real_score_cfg: bool = True
    min_timestep_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    max_timestep_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None

    needs = ("vae",)  # the experiment's VAE re-encodes the anchor (fvx.training.experiment.setup)

    def __post_init__(self) -> None:
        super().__post_init__()
        chunk = self.streaming_chunk_size or self.chunk_size
        fixed = self.streaming_fixed_overlap_latents
        if fixed is not None and fixed >= chunk:
            raise ValueError(f"method.streaming_fixed_overlap_latents = {fixed} must be smaller than the chunk "
                             f"(method.streaming_chunk_size or chunk_size = {chunk})")
        if self.grad_accum != 1:
            raise ValueError(f"method.grad_accum = {self.grad_accum}: streaming long tuning rolls a stream's chunk "
                             "once for the whole batch; use 1 (its gradients are taken block at a time)")
        dm.check_score_window(self.min_timestep_ratio or 0.0,
                              1.0 if self.max_timestep_ratio is None else self.max_timestep_ratio)
        self.stages(1)  # the schedule's form and order, before any weight loads

    def stages(self, data_frames: int) -> tuple[schedule.Stage, ...]:
        """The parsed schedule for data of ``data_frames`` latent frames."""
        return schedule.parse(self.multi_phased_distill_schedule, default_num_latent_t=data_frames,
                              default_chunk_size=self.streaming_chunk_size or self.chunk_size,
                              default_max_length=self.streaming_max_length)

    def score(self) -> dm.Score:
        """Self-Forcing's scores, clamped to the rounded window when a ratio is set, the normaliser floored at 1e-6
        and, with ``real_score_cfg`` false, the teacher unguided."""
        return dm.Score(self.flow_shift, self.flow_shift, self.min_timestep_ratio or 0.0,
                        1.0 if self.max_timestep_ratio is None else self.max_timestep_ratio,
                        self.guidance_scale if self.real_score_cfg else 1.0, self.cfg_uncond, "self_forcing",
                        round_window=True, normalizer_floor=1e-6)

    def carried_fields(self, experiment: Any) -> tuple[str, ...]:
        """What shapes the carried stream (a resume may not change them)."""
        student = self.roles.student
        return ("data.batch_size", "method.multi_phased_distill_schedule", "method.streaming_chunk_size",
                "method.streaming_max_length", "method.chunk_size", f"models.{student}.local_attn_size",
                f"models.{student}.sink_size", f"models.{student}.num_frames_per_block")

    def carried_bytes(self, models: Mapping[str, Model], grid: Any) -> int:
        """Bytes a sample's stream holds (the dry run): the student's KV cache for the longest streaming stage and
        the previous chunk's latents in fp32."""
        student = models[STUDENT]
        streaming = [s for s in self.stages(grid.frames) if s.streaming] or [None]
        frames = max(schedule.max_length(s) for s in streaming if s) if streaming[0] else grid.frames
        chunk = max((stage_chunk(s, self) for s in streaming if s), default=self.chunk_size)
        shape = (1, student.latents.channels, self.chunk_size, grid.height, grid.width)
        previous = 4 * student.latents.channels * chunk * grid.height * grid.width
        return student.causal.cache_bytes(frames, shape) + previous

    def build(self, models: Mapping[str, Model], *, total_steps: int, ranks: role.Ranks = role.ONE_PROCESS,
              before_update: role.BeforeUpdate | None = None, vae: Any = None) -> Program:
        """The loop's Program (``dm.program``) with the carried stream; the student (:meth:`check_models`), the VAE,
        the schedule against the data and the mesh are checked before any weights load."""
        codec = functools.cache(lambda: vae.build(random.key(0)))  # a VAE drawn at random: from key(0)
        shards = getattr(ranks, "shard_size", 1)

        def carry(batch: Batch) -> dict[str, Any]:
            stages = self.stages(dm.sample_shape(batch, self)[1])
            return empty_carry(batch, model=models[STUDENT], config=self, stages=stages, shards=shards)

        def step(state, batch, *, roles, config, frozen, negative, before):
            stages = config.stages(dm.sample_shape(batch, config)[1])
            state = state._replace(carry=carry(batch)) if state.carry is None else state
            return step_(state, batch, roles=roles, config=config, frozen=frozen, stages=stages, codec=codec,
                         negative=negative, before=before)

        program = dm.program(self, models, total_steps=total_steps, ranks=ranks, before_update=before_update,
                             step_=step, check=check_batch, validate=sf.validate)
        if self.streaming_reencode_overlap_anchor:
            check_vae(vae)
        if getattr(ranks, "replicate_size", 1) > 1 or getattr(ranks, "sp_size", 1) > 1:
            raise ValueError("streaming long tuning carries each rank's samples across steps: run it sharded over "
                             "every rank (no replica groups, no sequence parallelism)")
        return program._replace(carry=carry)

    def check_models(self, models: Mapping[str, Model]) -> None:
        """Self-Forcing's refusals (a block-causal student in blocks of ``chunk_size``), and a student that cannot
        allocate the KV cache the stream carries; ``dm.program`` and the dry run call it."""
        super().check_models(models)
        if models[STUDENT].causal.allocated_cache is None:
            raise ValueError(f"streaming long tuning carries the student's KV cache across steps, but model "
                             f"{models[STUDENT].name} cannot allocate one (Causal.allocated_cache)")

    def check_latent_frames(self, models: Mapping[str, Model], frames: int) -> None:
        """The schedule's stages against data of ``frames`` latent frames (:func:`check_stages`: the batch check's,
        and the dry run's on the samples it estimates)."""
        check_stages(frames, self)


def check_vae(vae: Any) -> None:
    """A ValueError unless the experiment's VAE can encode (the re-encoded anchor)."""
    if vae is None:
        raise ValueError("method.streaming_reencode_overlap_anchor re-encodes the overlap's first frame, but the "
                         "experiment has no vae; set one (with vae.encoder=true for a Wan VAE), or set "
                         "method.streaming_reencode_overlap_anchor=false")
    if getattr(vae, "encoder", True) is False:
        raise ValueError("method.streaming_reencode_overlap_anchor re-encodes the overlap's first frame, but the "
                         "experiment's vae loads no encoder: set vae.encoder=true")


def check_batch(batch: Batch, model: Model, config: StreamingLong, negative: Cond | None = None) -> None:
    """A ValueError (once, before the first step): ``dm.check_batch``'s, a
    stage longer than the data's frames, a short stage not of whole blocks, a streaming stage whose chunks would
    leave a short block or whose stream outgrows the student's positions."""
    dm.check_batch(batch, model, config, negative)
    check_stages(dm.sample_shape(batch, config)[1], config)


def check_stages(frames: int, config: StreamingLong) -> None:
    """A ValueError when a stage of the schedule does not fit data of ``frames`` latent frames: longer than it, a
    short stage not of whole blocks, a streaming stage whose chunks would leave a short block."""
    stages = config.stages(frames)
    for i, stage in enumerate(stages):
        where = f"method.multi_phased_distill_schedule[{i}]"
        if stage.num_latent_t > frames:
            raise ValueError(f"{where}: num_latent_t = {stage.num_latent_t} is longer than the data's {frames} latent "
                             "frames (FastVideo's rule: data.num_latent_t covers every stage's horizon)")
        if not stage.streaming:
            sf.check_frames(stage.num_latent_t, config, f"{where} (self_forcing)")
            continue
        check_whole_blocks(stage, config, where)


def check_whole_blocks(stage: schedule.Stage, config: StreamingLong, where: str) -> None:
    """A ValueError when a streaming stage's chunk arithmetic would make a chunk that is not whole blocks."""
    size, chunk = config.chunk_size, stage_chunk(stage, config)
    fixed = first_set(stage.fixed_overlap, config.streaming_fixed_overlap_latents)
    lengths = {"streaming_max_length": schedule.max_length(stage), "streaming_chunk_size": chunk}
    if fixed is not None:
        lengths["the new frames per chunk (chunk - streaming_fixed_overlap_latents)"] = chunk - fixed
    else:
        lengths["streaming_min_new_frame"] = max(1, first_set(stage.min_new_frame, config.streaming_min_new_frame,
                                                             chunk))
    for name, value in lengths.items():
        if value % size:
            raise ValueError(f"{where}: {name} = {value} is not whole blocks of method.chunk_size = {size}, so a chunk "
                             "would end in a short block, which fvx's causal students refuse (FastVideo's "
                             "streaming_require_full_blocks)")
