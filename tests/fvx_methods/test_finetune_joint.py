"""Fine-tuning models that make sound and picture (issue 31): MiniMax-H3's joint loss against a hand computation,
LTX-2's frozen audio branch (no update, no optimizer state, no adapters), and the refusals of the joint contract."""
import pathlib
import wave

import pytest
import torch

from fvx import run
from fvx.config import ConfigError
from fvx.core import flow, random, tree
from fvx.core.optim_config import AdamWConfig
from fvx.data.datasets import DataConfig
from fvx.data.toy_world import WorldConfig
from fvx.training import experiment, tracking
from fvx.training.experiment import Experiment
from fvx_methods import finetune
from fvx_methods.dmd2 import DMD2
from fvx_models import ltx2, minimax_h3
from fvx_models.kandinsky6 import Kandinsky6Config
from fvx_models.lora import LoRAConfig
from fvx_models.ltx2 import LTX2Config
from fvx_models.minimax_h3 import MiniMaxH3Config
from run_state import assert_resumes_bitwise  # noqa: E402 (tests/helpers, on the path by conftest)


@pytest.fixture(scope="module")
def joint():
    model = MiniMaxH3Config(preset="tiny").build()
    return model, model.weights.init(random.key(0))


def joint_batch(seed: int = 0, index: int = 7) -> dict:
    k = random.split(random.key(seed), 3)
    return {"latents": {"video": random.normal(k[0], (1, 48, 2, 4, 4)), "audio": random.normal(k[1], (1, 2, 32, 8))},
            "cond": {"text": random.normal(k[2], (1, 5, 32)), "text_mask": torch.ones(1, 5)},
            "sample_index": torch.tensor([index])}


def test_the_joint_loss_is_the_sum_of_the_modalities_losses_by_hand(joint):
    """Spec §2.1's joint loss: each modality noised with its own draw at its own level of the shared stage b,
    L = mean((v_video - (eps_video - x0_video))^2) + mean((v_audio - (eps_audio - x0_audio))^2)."""
    model, params = joint
    batch, key, config = joint_batch(), random.key(5), finetune.Finetune()
    loss, aux = finetune.loss_fn(params, batch, key, model=model, config=config)

    noise_key, t_key = random.split(random.fold_in(key, 7))
    b = random.uniform(t_key, ())
    sigma = {"video": 12 * b / (1 + 11 * b), "audio": 3 * b / (1 + 2 * b)}
    x0 = batch["latents"]
    noise = {name: random.normal(random.fold_in(noise_key, i), x0[name].shape[1:])[None]
             for i, name in enumerate(("video", "audio"))}
    x_t = {name: (1 - sigma[name]) * x0[name] + sigma[name] * noise[name] for name in x0}
    v = model.apply(params, x_t, {name: (1000 * sigma[name]).reshape(1) for name in x0}, batch["cond"])
    losses = {name: ((v[name] - (noise[name] - x0[name])) ** 2).mean() for name in x0}

    for name in x0:
        torch.testing.assert_close(aux[f"{name}_finetune_loss"], losses[name], rtol=1e-6, atol=0)
    torch.testing.assert_close(loss, losses["video"] + losses["audio"], rtol=1e-6, atol=0)
    torch.testing.assert_close(aux["sigma"], sigma["video"], rtol=1e-6, atol=0)
    assert set(finetune.logged(loss, aux)) == {"loss", "video_finetune_loss", "audio_finetune_loss"}


def test_a_joint_step_logs_each_modality_and_trains_both_heads(joint):
    model, _ = joint
    program = finetune.Finetune(optim=AdamWConfig(lr=1e-3)).build({"student": model}, total_steps=2)
    state = program.init(random.key(0))
    before = {name: p.clone() for name, p in state.roles["student"].params.items()}
    batch = joint_batch()
    program.check(batch)
    state, metrics = program.step_(state, program.frozen(random.key(0)), batch)
    assert {"loss", "video_finetune_loss", "audio_finetune_loss"} <= set(metrics)
    after = state.roles["student"].params
    assert not torch.equal(after["audio_proj_out.weight"], before["audio_proj_out.weight"])
    assert not torch.equal(after["proj_out.weight"], before["proj_out.weight"])


def test_a_joint_model_with_one_clock_takes_both_modalities_at_one_drawn_level():
    """Kandinsky 6 (train_audio) has no sampler of its own: each sample's level is the training grid's entry at u ~
    U(0, 1) from its own key, as for a video model, and both modalities are noised at it under one timestep."""
    model = Kandinsky6Config(preset="tiny", train_audio=True).build()
    params = model.weights.init(random.key(0))
    k = random.split(random.key(3), 4)
    batch = {"latents": {"video": random.normal(k[0], (2, 16, 2, 4, 4)), "audio": random.normal(k[1], (2, 1, 20, 6))},
             "cond": {"text": random.normal(k[2], (2, 5, 32)), "pooled": random.normal(k[3], (2, 16)),
                      "text_mask": torch.ones(2, 5)}, "sample_index": torch.tensor([4, 9])}
    key, config = random.key(5), finetune.Finetune(flow_shift=3.0)
    loss, aux = finetune.loss_fn(params, batch, key, model=model, config=config)

    x0 = model.normalize(batch["latents"])
    noise, t_keys = {"video": [], "audio": []}, []
    for index in (4, 9):
        noise_key, t_key = random.split(random.fold_in(key, index))
        t_keys.append(t_key)
        for i, name in enumerate(("video", "audio")):
            noise[name].append(random.normal(random.fold_in(noise_key, i), x0[name].shape[1:]))
    noise = {name: torch.stack(parts) for name, parts in noise.items()}
    sigma, t = flow.sample_training_sigmas(torch.stack(t_keys), flow.training_sigmas(3.0), "uniform")
    s = sigma.view(2, 1, 1, 1, 1)
    x_t = {"video": (1 - s) * x0["video"] + s * noise["video"], "audio": (1 - s[..., 0]) * x0["audio"]
           + s[..., 0] * noise["audio"]}
    v = model.apply(params, x_t, {"video": t, "audio": t}, batch["cond"])
    losses = {name: ((v[name] - (noise[name] - x0[name])) ** 2).mean() for name in x0}
    torch.testing.assert_close(loss, losses["video"] + losses["audio"], rtol=1e-6, atol=0)
    torch.testing.assert_close(aux["audio_finetune_loss"], losses["audio"], rtol=1e-6, atol=0)
    torch.testing.assert_close(aux["sigma"], sigma.mean(), rtol=1e-6, atol=0)


# --------------------------------------------------------------------------------------------- LTX-2's audio branch


def test_ltx2s_audio_branch_gets_no_update_and_no_optimizer_state():
    model = LTX2Config(preset="tiny").build()
    program = finetune.Finetune(optim=AdamWConfig(lr=1e-2, weight_decay=0.1)).build({"student": model},
                                                                                     total_steps=2)
    state, frozen = program.init(random.key(0)), program.frozen(random.key(0))
    audio = {name for name in model.memory_spec().shapes if ltx2.owns_audio(name)}
    assert audio and not audio & set(state.roles["student"].params)
    assert audio <= set(frozen["student"])  # held as the frozen base, bf16
    held = {name: frozen["student"][name].clone() for name in audio}
    moments = role_state_names(state)
    assert moments and not any(ltx2.owns_audio(name) for name in moments)
    k = random.split(random.key(3), 2)
    batch = {"latents": random.normal(k[0], (2, 8, 2, 4, 4)), "sample_index": torch.arange(2),
             "cond": {"text": random.normal(k[1], (2, 5, 24)), "text_mask": torch.ones(2, 5)}}
    state, _ = program.step_(state, frozen, batch)
    assert all(torch.equal(frozen["student"][name], held[name]) for name in audio)


def role_state_names(state) -> list[str]:
    """Every param name the student's optimizer state holds a tensor for (the last key of each leaf's path)."""
    paths, leaves, _ = tree.flatten_with_path(state.roles["student"].opt_state)
    return [path[-1] for path, leaf in zip(paths, leaves) if isinstance(leaf, torch.Tensor) and path
            and isinstance(path[-1], str)]


def test_ltx2_lora_adapts_the_video_branch_only():
    model = LTX2Config(preset="tiny", lora=LoRAConfig(rank=2, target_modules=("to_q", "to_k", "to_v"))).build()
    adapted = {name.rsplit(".", 2)[0] for name in model.weights.trained_names}
    assert adapted and not any(ltx2.owns_audio(f"{name}.weight") for name in adapted)
    assert any(name.startswith("transformer_blocks.0.attn1") for name in adapted)


# ----------------------------------------------------------------------------------------------------- refusals


class DMD2Joint(Experiment):
    models: dict[str, MiniMaxH3Config] = {}
    method: DMD2 = DMD2()


def test_a_method_of_one_modality_refuses_a_joint_model_before_building_it():
    config = DMD2Joint(data=DataConfig(kind="t2va"),
                       models={"student": MiniMaxH3Config(), "teacher": MiniMaxH3Config()})
    with pytest.raises(ConfigError, match=r"^models.student \(minimax_h3\) denoises video and audio together, but "
                                          r"method dmd2 trains one-modality models only \(role student\)"):
        experiment.build_models(config)


def test_the_coupled_validation_levels_are_the_training_shifts(joint):
    model, _ = joint
    levels = torch.tensor([1.0, 0.5, 0.0])
    shifted = model.rules.joint_sigmas(levels)
    video, audio = minimax_h3.coupled_sigmas(levels)
    assert torch.equal(shifted["video"], video) and torch.equal(shifted["audio"], audio)
    torch.testing.assert_close(shifted["video"], torch.tensor([1.0, 12 / 13, 0.0]))


# ---------------------------------------------------------------------------------------------------- whole runs


JOINT_EXPERIMENT = str(pathlib.Path(__file__).parents[2] / "experiments" / "finetune_minimax_h3.py")
QUICK = ["run.progress=false", "data.batch_size=2", "method.grad_accum=2", "data.prefetch=1",
         "method.optim.warmup_steps=1"]


def test_a_joint_run_resumes_bit_for_bit(tmp_path):
    state = assert_resumes_bitwise(JOINT_EXPERIMENT, tmp_path, [*QUICK, "validation.every=0"],
                                   ("loss", "video_finetune_loss", "audio_finetune_loss", "grad_norm"))
    assert any(name.endswith("audio_proj_out.weight") for name in state)


def test_validation_writes_a_wav_of_the_clips_duration_beside_each_gif(tmp_path):
    out = tmp_path / "run"
    assert run.main([JOINT_EXPERIMENT, "--out", str(out), "--steps", "1", *QUICK, "validation.every=1",
                     "validation.num_prompts=2", "validation.num_steps=2"]) == 0
    world = WorldConfig()  # the default's frames and frame rate: 4 frames at 16 fps, 0.25 s
    for step in (0, 1):
        folder = out / "validation" / f"step_{step}"
        wavs, gifs = sorted(folder.glob("*.wav")), sorted(folder.glob("*.gif"))
        assert len(wavs) == len(gifs) == 2
        for path in wavs:
            with wave.open(str(path)) as f:  # a valid WAV: the standard library reads its header
                assert (f.getnchannels(), f.getsampwidth(), f.getframerate()) == (2, 2, world.audio_rate)
                assert f.getnframes() / f.getframerate() == world.frames / world.fps
    logged = tracking.read_audio(out / "tb", "validation/model/audio_0")
    assert [(step, rate, length) for step, rate, length in logged] == [(0, world.audio_rate, world.audio_samples),
                                                                      (1, world.audio_rate, world.audio_samples)]
    scalars = tracking.read_scalars(out / "tb")
    wanted = {"validation/model/pitch_match", "validation/model/audio_mse", "validation/model/nearest_mse"}
    assert wanted <= set(scalars)


K6_EXPERIMENT = str(pathlib.Path(__file__).parents[2] / "experiments" / "finetune_kandinsky6.py")
K6_I2VA = ["models.student.first_frame=true", "models.student.train_audio=true", "audio_vae=audio_frames"]


def test_kandinsky6_image_to_video_with_sound_trains_from_i2va_data_and_names_it_for_other_data(tmp_path, capsys):
    """Kandinsky 6's image=... call with sample_audio: i2va data gives the first frame and the sound; validation
    starts from the data's first frames (continuation_mse) and scores the sound. i2v data (no sound) and t2va data (no
    first frame) are each refused in one line naming data.kind=i2va."""
    out = tmp_path / "run"
    assert run.main([K6_EXPERIMENT, "--out", str(out), "--steps", "1", *QUICK, *K6_I2VA, "data.kind=i2va",
                     "validation.every=1", "validation.num_prompts=2", "validation.num_steps=2"]) == 0
    assert len(sorted((out / "validation" / "step_1").glob("*.wav"))) == 2
    scalars = tracking.read_scalars(out / "tb")
    assert {"validation/model/continuation_mse", "validation/model/pitch_match"} <= set(scalars)
    for kind in ("i2v", "t2va"):
        capsys.readouterr()
        assert run.main([K6_EXPERIMENT, "--out", str(tmp_path / kind), "--steps", "1", *QUICK, *K6_I2VA,
                         f"data.kind={kind}"]) == 2
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and "data.kind=i2va" in error[0]
        assert not (tmp_path / kind).exists()
