"""fvx_methods.streaming_long: the chunk arithmetic and the gradient mask for FastVideo's values, the re-encoded anchor
against diffusers' VAE, the masked losses against hand computation, the step across stages, bad input, and runs
resumed inside a stream (spec §2.8)."""
import pathlib
import types

import pytest
import torch
from diffusers import AutoencoderKLWan

from fvx import run
from fvx.core import flow, random, tree
from fvx.core.optim_config import AdamWConfig
from fvx.data.toy_world import Codec
from fvx.storage import checkpoint
from fvx.training import replay, run_folder, tracking
from fvx_methods import streaming_long as sl
from fvx_methods.library import distribution_matching as dm
from fvx_models import wan_vae
from fvx_models.model import LatentSpace
from fvx_models.wan import WanConfig
from fvx_models.wan_causal import WanCausalConfig
from fvx_models.wan_vae import WanVAEConfig

from gloo import launch1, launch2  # noqa: E402
from run_state import final_state, start_state  # noqa: E402

EXPERIMENT = str(pathlib.Path(__file__).resolve().parents[2] / "experiments" / "streaming_long_causal_t2v.py")
IDENTITY = LatentSpace(channels=16)
IDENTITY_CODEC = types.SimpleNamespace(encode=lambda video: video, decode=lambda latents: latents)


def recipe(**knobs):
    """FastVideo's world-model streaming values: blocks of 3, chunks of 9, fixed overlap 3, streams of 39."""
    return sl.StreamingLong(**{"chunk_size": 3, "streaming_chunk_size": 9, "streaming_fixed_overlap_latents": 3,
                               "streaming_max_length": 39, **knobs})


def plans(config, frames, key=random.key(0)):
    """``(length, new, overlap)`` of every chunk of one stream of ``config``'s first stage."""
    stage, out, length, kept = config.stages(frames)[0], [], 0, 0
    while length < sl.schedule.max_length(stage):
        new, overlap = sl.chunk_plan(length, kept, stage, config, random.fold_in(key, length))
        out.append((length, new, overlap))
        kept = min(sl.stage_chunk(stage, config), new + overlap)
        length += new
    return out


def test_the_chunks_of_the_world_model_recipe():
    """Chunks of 9 with a fixed overlap of 3 over 39 frames: 9 new, then 6 new after 3 of overlap, 6 chunks."""
    assert plans(recipe(), 39) == [(0, 9, 0), (9, 6, 3), (15, 6, 3), (21, 6, 3), (27, 6, 3), (33, 6, 3)]


def test_longlive_chunks_and_drawn_lengths():
    """LongLive's 21/18 takes 18 new frames until the last short chunk; a free length is drawn from
    ``range(min_new, max_new, chunk_size)`` by the key, the same for the same key."""
    longlive = recipe(streaming_chunk_size=21, streaming_fixed_overlap_latents=None, streaming_min_new_frame=18,
                      streaming_max_length=60)
    assert plans(longlive, 60) == [(0, 21, 0), (21, 18, 3), (39, 18, 3), (57, 3, 18)]
    drawn = recipe(streaming_fixed_overlap_latents=None, streaming_min_new_frame=3)
    stage = drawn.stages(39)[0]
    news = {sl.chunk_plan(9, 9, stage, drawn, random.key(k))[0] for k in range(20)}
    assert news == {3, 6}
    assert sl.chunk_plan(9, 9, stage, drawn, random.key(5)) == sl.chunk_plan(9, 9, stage, drawn, random.key(5))


def test_the_gradient_mask_covers_the_new_frames_only():
    previous, pred = torch.rand(2, 4, 9, 2, 2) * 2 - 1, torch.rand(2, 4, 6, 2, 2) * 2 - 1
    config = recipe(streaming_reencode_overlap_anchor=False)
    full, mask = sl.with_overlap(previous, pred, 3, 9, config, None, IDENTITY)
    assert torch.equal(full, torch.cat([previous[:, :, 6:], pred], dim=2))
    assert mask.flatten().tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1]
    first, mask = sl.with_overlap(previous[:, :, :0], pred, 0, 9, config, None, IDENTITY)
    assert torch.equal(first, pred) and mask.flatten().tolist() == [1] * 6


def test_a_lossless_codec_leaves_the_anchor_as_it_was():
    """Through the toy world's exact codec, decoding the frames before the window and re-encoding the last pixel frame
    gives back the window's first latent frame (k 1), and re-encoding the first k frames gives them back."""
    previous, pred = torch.rand(2, 192, 9, 2, 2) * 2 - 1, torch.rand(2, 192, 6, 2, 2) * 2 - 1
    plain, _ = sl.with_overlap(previous, pred, 3, 9, recipe(streaming_reencode_overlap_anchor=False), None, IDENTITY)
    for k in (1, 2):
        full, _ = sl.with_overlap(previous, pred, 3, 9, recipe(streaming_anchor_inject_k=k), lambda: Codec(8),
                                  LatentSpace(channels=192))
        torch.testing.assert_close(full, plain, rtol=0, atol=1e-6)


def test_the_reencoded_anchor_is_diffusers_decode_then_encode():
    """k 1 on the tiny Wan VAE: the anchor is diffusers' encode (posterior mode) of the last pixel frame of its decode
    of every latent frame before the window's last P - 1, the model's normalisation around both."""
    latents = LatentSpace(channels=16, mean=tuple(0.1 * i for i in range(16)),
                          std=tuple(1 + 0.1 * i for i in range(16)))
    vae = WanVAEConfig(encoder=True).build(random.key(0))
    with torch.device("meta"):
        module = AutoencoderKLWan(**wan_vae.PRESETS["tiny"])
    module.load_state_dict(wan_vae.init(wan_vae.skeleton("tiny", encoder=True)[0], random.key(0)), assign=True)
    frames = random.normal(random.key(3), (1, 16, 5, 4, 4))
    full = sl.anchored(frames, 3, 1, vae, latents)
    with torch.no_grad():
        video = (module.eval().decode(latents.denormalize(frames[:, :, :3])).sample / 2 + 0.5).clamp(0, 1)
        anchor = latents.normalize(module.encode(2 * video[:, :, -1:] - 1).latent_dist.mode())
    torch.testing.assert_close(full[:, :, :1], anchor, rtol=1e-5, atol=1e-5)
    assert torch.equal(full[:, :, 1:], frames[:, :, 3:])


def stub(v):
    """A model whose velocity is ``v(x)`` (for hand computations of the losses)."""
    return types.SimpleNamespace(apply=lambda params, x, t, cond: v(x), uncond=None)


def test_the_masked_losses_by_hand():
    """masked_mean divides by the mask's elements; the DMD loss's per-sample normaliser is floored at 1e-6 and its
    gradient is the autograd one; the critic's loss is its flow matching on the new frames only."""
    values, mask = torch.arange(12.0).view(1, 1, 3, 2, 2), torch.tensor([0.0, 1, 1]).view(1, 1, 3, 1, 1)
    assert sl.masked_mean(values, mask) == torch.arange(4.0, 12).sum() / 8
    config = recipe(min_timestep_ratio=0.02, max_timestep_ratio=0.98)
    score, full = config.score(), torch.randn(2, 4, 3, 2, 2) * torch.tensor([1.0, 5.0]).view(2, 1, 1, 1, 1)
    stream = {"cond": {}, "sample_index": torch.tensor([3, 8])}
    roles = types.SimpleNamespace(critic=stub(torch.zeros_like), teacher=stub(torch.ones_like))
    loss, normalizer, d_full = sl.masked_dmd(full, mask, {}, {}, stream, random.key(4), roles=roles, score=score,
                                             negative=None)
    x_t, _, t = dm.noised(full, stream["sample_index"], random.key(4), score, score.grid())
    assert 20 <= t.min() and t.max() <= 980  # round(1000 ratio)
    sigma = flow.nearest_grid_sigma(score.grid(), t).view(2, 1, 1, 1, 1)  # x0_fake - x0_real = sigma
    by_hand = (full - (x_t - sigma)).abs().mean(dim=(1, 2, 3, 4)).clamp_min(1e-6)
    torch.testing.assert_close(normalizer, by_hand)
    per_element = 0.5 * (sigma / by_hand.view(2, 1, 1, 1, 1)) ** 2 * mask
    torch.testing.assert_close(loss, per_element.expand_as(full).sum() / (2 * 4 * 2 * 2 * 2))
    leaf = full.clone().requires_grad_(True)
    target = full - sigma / by_hand.view(2, 1, 1, 1, 1)
    torch.testing.assert_close(d_full, torch.autograd.grad(sl.masked_mean(0.5 * (leaf - target) ** 2, mask), leaf)[0])
    chunk = {**stream, "x0": full, "mask": mask}
    critic_loss, _ = sl.masked_critic_loss({}, chunk, random.key(5), critic=stub(torch.zeros_like), score=score)
    _, noise, _ = dm.noised(full, stream["sample_index"], random.key(5), score, score.grid())
    torch.testing.assert_close(critic_loss, sl.masked_mean((noise - full) ** 2, mask))


# ---------------------------------------------------------------------------------------------- the step


@pytest.fixture(scope="module")
def program():
    """A tiny causal student in blocks of 1 on a window of 2 (sink 1) and a tiny teacher: first a Self-Forcing
    stage on 2 frames (iteration 1), then streams of 4 frames in chunks of 2 after 1 frame of overlap."""
    student, bidirectional = (WanCausalConfig(preset="tiny", num_frames_per_block=1, local_attn_size=2,
                                              sink_size=1).build(), WanConfig(preset="tiny").build())
    config = sl.StreamingLong(chunk_size=1, streaming_chunk_size=2, streaming_fixed_overlap_latents=1,
                              multi_phased_distill_schedule="2:2,100:4", latent_shape=(16, 4, 4, 4),
                              denoising_steps=(1000, 500), optim=AdamWConfig(lr=1e-3),
                              critic_optim=AdamWConfig(lr=1e-3))
    return config.build({"student": student, "critic": bidirectional, "teacher": bidirectional}, total_steps=8,
                        vae=types.SimpleNamespace(build=lambda key: IDENTITY_CODEC))


def text_batch(offset):
    g = torch.Generator().manual_seed(offset)
    return {"cond": {"text": torch.randn(2, 8, 32, generator=g), "text_mask": torch.ones(2, 8)},
            "sample_index": torch.arange(offset, offset + 2)}


def steps(program, n, key=random.key(0)):
    state, frozen, logged = program.init(key), program.frozen(key), []
    state = state._replace(carry=program.carry(text_batch(0)))
    for s in range(n):
        state, metrics = program.step_(state, frozen, text_batch(2 * s))
        logged.append({name: float(value) for name, value in metrics.items()})
    return state, logged


def test_the_step_goes_from_self_forcing_to_streams_that_restart(program):
    state, logged = steps(program, 6)
    assert [m["distill_stage_index"] for m in logged] == [0, 1, 1, 1, 1, 1]
    assert logged[0]["active_num_latent_t"] == 2 and "streaming_current_length" not in logged[0]
    assert [m["streaming_current_length"] for m in logged[1:]] == [2, 3, 4, 2, 3]
    assert [m["streaming_overlap"] for m in logged[1:]] == [0, 1, 1, 0, 1]
    assert [m["update_student"] for m in logged] == [1] * 6 and all("generator_loss" in m for m in logged)
    rows, at = state.carry[sl.ROWS], state.carry[sl.AT]
    assert int(at["length"]) == 3 and int(at["next_frame"]) == 3 and int(at["stage"]) == 1
    assert at["slots"].tolist() == [0, 2]  # the sink frame and the window's last frame before the next block
    assert torch.equal(rows["sample_index"], torch.arange(8, 10))  # the stream restarted on step 4's batch
    again, _ = steps(program, 6)
    assert all(torch.equal(a, b) for a, b in zip(tree.tensor_leaves(state), tree.tensor_leaves(again), strict=True))


def test_bad_configs_and_students_are_refused():
    with pytest.raises(ValueError, match="streaming_fixed_overlap_latents = 9 must be smaller"):
        recipe(streaming_fixed_overlap_latents=9)
    with pytest.raises(ValueError, match=r"\[1\].start_step"):
        recipe(multi_phased_distill_schedule="8:3,2:6:39")
    with pytest.raises(ValueError, match="grad_accum"):
        recipe(grad_accum=2)
    bidirectional = WanConfig(preset="tiny").build()
    with pytest.raises(ValueError, match="needs a block-causal student"):
        recipe().build({"student": bidirectional, "critic": bidirectional, "teacher": bidirectional}, total_steps=1,
                       vae=Codec(1))
    causal = WanCausalConfig(preset="tiny", num_frames_per_block=3).build()
    for vae, match in [(None, "the experiment has no vae"), (WanVAEConfig(), "set vae.encoder=true")]:
        with pytest.raises(ValueError, match=match):
            recipe().build({"student": causal, "critic": bidirectional, "teacher": bidirectional}, total_steps=1,
                           vae=vae)


def test_schedules_that_do_not_fit_the_data_are_refused():
    model = WanCausalConfig(preset="tiny", num_frames_per_block=3).build()
    for knobs, match in [({"streaming_max_length": 42}, "num_latent_t = 42 is longer than the data's 39"),
                         ({"streaming_fixed_overlap_latents": 4}, "chunk - streaming_fixed_overlap_latents\\) = 5 "
                                                                 "is not whole blocks"),
                         ({"multi_phased_distill_schedule": "4:5,20:39"}, "5 latent frames are not whole blocks")]:
        config = recipe(latent_shape=(16, 39, 4, 4), **knobs)
        with pytest.raises(ValueError, match=match):
            sl.check_batch(text_batch(0), model, config)
    sl.check_batch(text_batch(0), model, recipe(latent_shape=(16, 39, 4, 4)))


# ----------------------------------------------------------------------------------------------- end to end


def quick(world_teacher):
    return ["run.progress=false", "data.batch_size=2", "validation.every=0", "run.checkpoint.every=2",
            "run.checkpoint.async_save=false", f"models.student.path={world_teacher}",
            f"models.teacher.path={world_teacher}"]


@pytest.mark.slow  # three short runs of the toy world's models
def test_a_run_resumed_inside_a_stream_is_the_uninterrupted_run(tmp_path, world_teacher, capsys):
    """5 steps (one stream: 4 frames, then 2 new after 2 of overlap) whole, and 3 resumed to 5 (inside the
    stream, the re-encoded anchor in play): the same logged metrics and final state, the carried stream included;
    a resume that changes the chunk or the window is one line naming the field; a replay of step 3 starts from the
    carry of checkpoint 2 and matches the log bitwise."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert run.main([EXPERIMENT, "--out", str(whole), "--steps", "5", *quick(world_teacher)]) == 0
    assert run.main([EXPERIMENT, "--out", str(resumed), "--steps", "3", "run.checkpoint.final=true",
                     *quick(world_teacher)]) == 0
    for change in ("method.streaming_chunk_size=6", "models.student.local_attn_size=6"):
        assert run.main([EXPERIMENT, "--out", str(resumed), "--steps", "5", "--resume", *quick(world_teacher),
                         change]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and change.split("=")[0] in err[0] and "carried state no longer fits" in err[0], err
    assert run.main([EXPERIMENT, "--out", str(resumed), "--steps", "5", "--resume", *quick(world_teacher)]) == 0
    expected, logged = tracking.read_scalars(whole / "tb"), tracking.read_scalars(resumed / "tb")
    assert [v for _, v in expected["streaming_current_length"]] == [4, 6, 8, 10, 12]
    for name in ("critic_loss", "generator_loss", "grad_norm/student", "streaming_current_length"):
        assert logged[name] == expected[name], name
    state, expected_state = final_state(resumed), final_state(whole)
    assert state.keys() == expected_state.keys() and any(name.startswith("carry.") for name in state)
    assert all(torch.equal(tensor, expected_state[name]) for name, tensor in state.items())
    replayed = replay.replay(whole, 3)  # from checkpoint 2, whose carry is the stream 8 frames long
    rows = replay.compare(replayed.metrics, replay.logged_metrics(whole, 3))
    assert replayed.from_checkpoint == 2 and all(row.same for row in rows if row.logged is not None), rows


@pytest.mark.slow  # 2 + 1 processes
def test_two_processes_stream_as_one_and_their_carry_restores_in_one(tmp_path, world_teacher):
    """3 steps of a stream (the anchor re-encoded at steps 2 and 3) on 2 gloo processes log what 1 process logs, and
    the 2-process checkpoint's carried stream (each rank's 2 samples) restores into one process's state as the
    1-process run saved it (within the reduction-order rounding of the params that made it)."""
    knobs = (f"models.student.path={world_teacher}", f"models.teacher.path={world_teacher}",
             "method.generator_update_interval=1", "run.checkpoint.final=true")
    launch2(tmp_path / "two", *knobs, experiment=EXPERIMENT)
    launch1(tmp_path / "one", *knobs, experiment=EXPERIMENT)
    two, one = (tracking.read_scalars(tmp_path / name / "tb") for name in ("two", "one"))
    for name in ("critic_loss", "generator_loss", "grad_norm/student", "streaming_current_length"):
        assert len(two[name]) == 3, name
        for (_, got), (_, want) in zip(two[name], one[name]):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-8), (name, two[name], one[name])
    with checkpoint.Checkpoints(tmp_path / "two" / "checkpoints") as saved:
        restored = checkpoint.leaves_by_name(saved.restore(3, start_state(run_folder.load_run(tmp_path / "two"))))
    expected = final_state(tmp_path / "one")
    carried = [name for name in expected if name.startswith("carry.")]
    assert any("cache.keys" in name for name in carried)
    assert restored["carry.rows.sample_index"].tolist() == [0, 1, 2, 3]
    for name in carried:  # 3 steps of training amplify the rounding: a few of 12288 entries differ by 2e-4 on AVX-512
        torch.testing.assert_close(restored[name], expected[name], rtol=1e-3, atol=1e-3, msg=name)


def test_bad_input_from_the_cli_is_one_line_and_writes_nothing(tmp_path, capsys, world_teacher):
    paths = [f"models.student.path={world_teacher}", f"models.teacher.path={world_teacher}"]
    for override, message in [("method.streaming_max_length=16", "num_latent_t = 16 is longer than the data's 12"),
                              ("method.streaming_fixed_overlap_latents=4", "must be smaller than the chunk"),
                              ("method.multi_phased_distill_schedule=0:8:4,4:20:12", "[1].start_step")]:
        out = tmp_path / "run"
        assert run.main([EXPERIMENT, "--out", str(out), *paths, override]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not out.exists()


def test_the_dry_run_counts_the_carried_cache(capsys):
    """FastVideo's streaming recipe (Matrix-Game 2.0) on 8 ranks: a ring of 4 latent frames of 480x832 (1560 tokens)
    in bf16 per rank, the 30 self-attention layers' keys and values (12 heads of 128) and the 15 action blocks'
    mouse and keyboard ones (16 heads of 64 each)."""
    recipe = EXPERIMENT.replace("streaming_long_causal_t2v.py",
                                "worldmodel_matrixgame2.py:zelda_streaming_long_tuning_causal_i2v")
    assert run.main([recipe, "--dry-run", "--world", "8"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("carried across steps"))
    per_token = 30 * 12 * 128 + 15 * 2 * 16 * 64
    assert float(row.split()[-1]) == pytest.approx(2 * 2 * 4 * 1560 * per_token / 2**30, abs=0.01)
