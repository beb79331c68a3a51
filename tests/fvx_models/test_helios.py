"""Helios (fvx_models.helios): its forward is diffusers' DiT called as HeliosPipeline calls it on a chunk and its
memory (fvx.data.sections' chunks order), batched; its training corruption of the memory as Helios's stage-1 recipe
corrupts it, drawn per sample; its export a HeliosPipeline folder."""
import inspect
import json

import pytest
import torch
from diffusers import HeliosScheduler, HeliosTransformer3DModel

from fvx.core import flow, random
from fvx.data import sections
from fvx.data.sections import SectionsConfig
from fvx_methods import finetune
from fvx_models import helios, wan
from fvx_models.helios import HeliosConfig

CHUNKS = SectionsConfig(window=2, order="chunks")


@pytest.fixture(scope="module")
def model():
    return HeliosConfig(preset="tiny").build()


@pytest.fixture(scope="module")
def params(model):
    return model.weights.init(random.key(0))


def chunk_batch(sections_of=(1, 2), key: int = 1) -> dict:
    """A data batch of chunks (sample b: chunk ``sections_of[b]`` of a random 6-frame clip), UMT5-like text with the
    last sample's two final tokens padding."""
    k = random.split(random.key(key), 2)
    parts = [sections.cut(random.normal(random.fold_in(k[0], n), (16, 6, 4, 4)), CHUNKS)[n] for n in sections_of]
    mask = torch.ones(len(parts), 5)
    mask[-1, -2:] = 0
    return {"latents": torch.stack([p["latents"] for p in parts]), "text": random.normal(k[1], (len(parts), 5, 32)),
            "text_mask": mask, "framepack_history": torch.stack([p["history"] for p in parts]),
            "frame_indices": torch.stack([p["frame_indices"] for p in parts]), "sample_index": torch.arange(len(parts))}


def pipeline_call(module, x, t, batch):
    """HeliosPipeline's transformer call: the text zero-padded, the memory split [prefix, 1x] / mid / long, their
    indices [1, T] int64 (the pipeline's; every chunk but a clip's first has the same positions)."""
    index, memory, window = batch["frame_indices"][:1].long(), batch["framepack_history"], x.shape[2]
    return module(hidden_states=x, timestep=t, encoder_hidden_states=batch["text"] * batch["text_mask"][..., None],
                  indices_hidden_states=index[:, :window], indices_latents_history_short=index[:, window:window + 2],
                  indices_latents_history_mid=index[:, window + 2:window + 4],
                  indices_latents_history_long=index[:, window + 4:], latents_history_short=memory[:, :, :2],
                  latents_history_mid=memory[:, :, 2:4], latents_history_long=memory[:, :, 4:],
                  return_dict=False)[0]


def test_apply_equals_the_pipelines_call_on_chunks_and_their_memory(model, params):
    batch = chunk_batch()
    x, t = random.normal(random.key(5), tuple(batch["latents"].shape)), torch.tensor([640.0, 37.5])
    ours = model.apply(params, x, t, model.batch(batch)["cond"])
    state = torch.get_rng_state()
    module = HeliosTransformer3DModel(**HeliosConfig(preset="tiny").spec.kwargs)
    torch.set_rng_state(state)
    module.load_state_dict(params)
    with torch.no_grad():
        reference = pipeline_call(module, x, t, batch)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_the_memory_changes_the_velocity_and_a_chunk_is_batched(model, params):
    batch = chunk_batch()
    x, t = random.normal(random.key(5), tuple(batch["latents"].shape)), torch.tensor([640.0, 640.0])
    base = model.apply(params, x, t, model.batch(batch)["cond"])
    shifted = {**batch, "framepack_history": batch["framepack_history"] + 1}
    moved = model.apply(params, x, t, model.batch(shifted)["cond"])
    assert (moved - base).abs().amax(dim=(1, 2, 3, 4)).min() > 1e-3
    alone = model.apply(params, x[1:], t[1:], model.batch({k: v[1:] for k, v in batch.items()})["cond"])
    torch.testing.assert_close(alone, base[1:], rtol=1e-5, atol=1e-5)


def test_the_training_corruption_drops_then_noises_the_memory_as_helios_does():
    """``corrupt_history`` against the cases drawn by hand: a sample whose memory is all dropped stays zero (a group
    of zeros is not noised); one whose oldest 1 + 9 n frames are dropped keeps those zero; the one in ten left clean
    is unchanged; every other frame gets its own s ~ U(0, 1/3), which its noise's weight shows."""
    keys = torch.vmap(lambda i: random.fold_in(random.key(3), i))(torch.arange(64))
    memory = torch.randn(64, 3, 20, 2, 2) + 5  # no frame is zero
    out = helios.corrupt_history(keys, memory, window=9)
    zero = out.abs().sum(dim=(1, 3, 4)) == 0  # [64, 20]
    changed = (out - memory).abs().sum(dim=(1, 3, 4)) > 0
    ages = helios.AGES  # the memory slots' ages, oldest first (-1: the first frame)
    all_dropped = zero.all(1)
    for b in range(64):
        if all_dropped[b]:
            continue
        old = zero[b] & (ages >= 0)
        count = int(old.sum())
        assert count in (0, 1, 10, 19) and not zero[b, 0]  # the first frame is kept
        assert torch.equal(old, (ages >= 0) & (ages < count))  # the oldest ones
        kept = changed[b][~zero[b]]
        assert kept.all() or not kept.any()  # every frame left noised, or the clean case
    clean = ~all_dropped & ~changed.any(1)
    assert 0.2 < all_dropped.float().mean() < 0.6 and 0 < clean.sum() < 16
    assert torch.equal(helios.corrupt_history(keys, memory, 9), out)  # a function of the keys alone


def test_fine_tuning_scores_the_chunk_beside_each_samples_own_corrupted_memory(model, params):
    """finetune.loss_fn against the loss written out: each sample's noise and level from its key, its memory corrupted
    from ``fold_in(level key, 1)``, the velocity loss over the chunk."""
    batch = model.batch(chunk_batch())
    config = finetune.Finetune()
    key = random.key(7)
    loss, _ = finetune.loss_fn(params, batch, key, model=model, config=config)
    x0 = model.normalize(batch["latents"])
    noise, t_keys = flow.per_sample_noise(key, batch["sample_index"], tuple(x0.shape[1:]), x0.device)
    sigma, t = finetune.draw_sigmas(t_keys, x0, model=model, config=config)
    keys = torch.vmap(lambda k: random.fold_in(k, 1))(t_keys)
    cond = {**batch["cond"], "framepack_history": helios.corrupt_history(keys, batch["cond"]["framepack_history"], 2)}
    v = model.apply(params, flow.add_noise(x0, noise, sigma), t, cond)
    torch.testing.assert_close(loss, ((v - (noise - x0)) ** 2).mean())
    uncorrupted = model.apply(params, flow.add_noise(x0, noise, sigma), t, batch["cond"])
    assert not torch.allclose(((uncorrupted - (noise - x0)) ** 2).mean(), loss)


def test_presets_give_every_constructor_argument_and_the_release_is_helios_base():
    signature = inspect.signature(HeliosTransformer3DModel.__init__).parameters
    assert HeliosConfig(preset="helios").spec.kwargs == {n: p.default for n, p in signature.items() if n != "self"}
    for name in helios.PRESETS:
        assert set(HeliosConfig(preset=name).spec.kwargs) == set(signature) - {"self"}, name
    assert HeliosConfig(preset="helios").spec.latents == wan.WAN21_VAE


def test_an_export_is_a_helios_pipeline_folder_with_one_stage(model, params, tmp_path):
    written = model.export.folder(params, str(tmp_path))
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "HeliosPipeline" and index["scheduler"] == ["diffusers", "HeliosScheduler"]
    assert HeliosScheduler.from_pretrained(tmp_path / "scheduler").config.stages == 1
    loaded = HeliosTransformer3DModel.from_pretrained(written.files["transformer"])
    assert all(torch.equal(p, params[name]) for name, p in loaded.state_dict().items())


def test_video_latents_are_each_33_frame_chunk_encoded_on_its_own(tmp_path):
    """Helios's data encodes a clip chunk by chunk (33 frames each: 17 latent frames with this VAE's 2x in time), so
    every chunk's first latent frame is a first frame's; encoding the whole clip at once gives other latents."""
    import encoder_checks
    import tiny_wan_pipeline

    opened = helios.ENCODERS.open(tiny_wan_pipeline.save(tmp_path / "wan"), ["video"])
    video = encoder_checks.random_clip((3, 66, 16, 16))
    latents = opened.encode_video(video)
    chunks = [opened.pipe.vae.encode(video[None, :, s:s + 33]).latent_dist.mean[0] for s in (0, 33)]
    assert latents.shape == (4, 34, 8, 8) and torch.equal(latents, torch.cat(chunks, dim=1))
    whole = opened.pipe.vae.encode(video[None, :, :65]).latent_dist.mean[0]
    assert not torch.allclose(latents[:, 17:33], whole[:, 17:33], atol=1e-3)
    assert (helios.ENCODERS.frame_base, helios.ENCODERS.frame_step) == (33, 33)
