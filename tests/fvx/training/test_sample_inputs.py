"""A section video's given start (fvx.training.sample_inputs.Start): Helios's chunks from an image against
HeliosPipeline's history bookkeeping, written out from diffusers' pipeline_helios.py, and the start's noise."""
import numpy
import pytest
import torch

from fvx.core import random
from fvx.data.sections import SectionsConfig
from fvx.training import sample_inputs, sampling, validation
from fvx.training.sample_inputs import Start

C, H, W, WINDOW = 3, 2, 2, 2


def test_helios_chunks_from_an_image_see_the_pipelines_history(monkeypatch):
    """``HeliosPipeline(image=...)`` (keep_first_frame): the history starts as 19 zero frames whose newest is the
    noised still-image latent (``fake_image_latents``); every chunk reads the noised image latent as its prefix and
    the newest 19 frames as 16 long, 2 mid and 1 short; each chunk's latents are appended. Its RoPE indices: prefix 0,
    long 1..16, mid 17..18, short 19, the chunk's frames from 20. The video is the chunks alone, as the pipeline's."""
    seen = []

    def draw(sampler, noise, cond, keys, uncond, guidance):  # the chunk's latents: its number, everywhere
        seen.append(cond)
        return torch.full_like(noise, float(len(seen))), None

    monkeypatch.setattr(validation, "draw", draw)
    image, before = torch.randn(1, C, 1, H, W), torch.randn(1, C, 1, H, W)
    start, keys = Start(image, before, noised=True), random.key(3)[None]
    cut = sample_inputs.made_cut(SectionsConfig(window=WINDOW, order="chunks"), image)
    made = sampling.draw_sections(None, torch.zeros(1, C, 1 + 3 * WINDOW, H, W), {}, keys, None, 1.0, cut, start)
    noised = sample_inputs.noised_start(start, keys)

    history = torch.cat([torch.zeros(1, C, 18, H, W), noised.before], dim=2)
    for chunk, cond in enumerate(seen):
        long, mid, short = history[:, :, -19:].split([16, 2, 1], dim=2)
        assert torch.equal(cond["framepack_history"], torch.cat([noised.image, short, mid, long], dim=2))
        indices = torch.cat([torch.arange(20, 20 + WINDOW), torch.tensor([0, 19, 17, 18]), torch.arange(1, 17)])
        assert torch.equal(cond["frame_indices"][0], indices.float())
        history = torch.cat([history, torch.full((1, C, WINDOW, H, W), chunk + 1.0)], dim=2)
    assert len(seen) == 3 and torch.equal(made, history[:, :, 19:])


def test_the_start_is_noised_at_its_own_level_from_each_videos_key():
    """``x = s e + (1 - s) x``, ``s ~ U(0.111, 0.135)`` drawn for the image and for the frame before apart: on a
    constant start of many elements the mean is ``(1 - s) x`` and the spread ``s``; a video's key fixes its draws."""
    ones = torch.ones(1, 4, 1, 64, 64)
    keys = torch.stack([random.key(0), random.key(1)])
    start = Start(ones.expand(2, -1, -1, -1, -1), 2 * ones.expand(2, -1, -1, -1, -1), noised=True)
    noised = sample_inputs.noised_start(start, keys)
    for x, level in ((noised.image, 1.0), (noised.before, 2.0)):
        for row in x:
            s = row.std().item()
            assert 0.105 < s < 0.141 and abs(row.mean().item() - (1 - s) * level) < 0.01
    assert not torch.equal(noised.image[0], noised.image[1])
    def unit(x):  # the draw e of a noised constant: (x - mean) / std
        return (x - x.mean()) / x.std()

    assert not torch.allclose(unit(noised.image[0]), unit(noised.before[0]), atol=0.1)  # draws of their own
    again = sample_inputs.noised_start(Start(start.image[:1], start.before[:1], noised=True), keys[:1])
    assert torch.equal(again.image, noised.image[:1]) and torch.equal(again.before, noised.before[:1])


def test_framepacks_last_image_is_the_frame_after_the_first_section_made(monkeypatch):
    """``HunyuanVideoFramepackPipeline(last_image=...)``: the first section made (the last, inverted anti-drifting)
    reads the last image's latent as its 1x history, the frame after it; later sections read the frames made after
    them, the last image no more. The video holds no frame of it."""
    seen = []

    def draw(sampler, noise, cond, keys, uncond, guidance):
        seen.append(cond)
        return torch.full_like(noise, float(len(seen))), None

    monkeypatch.setattr(validation, "draw", draw)
    image, last = torch.randn(1, C, 1, H, W), torch.randn(1, C, 1, H, W)
    cut = SectionsConfig(window=WINDOW, order="inverted_anti_drifting")
    made = sampling.draw_sections(None, torch.zeros(1, C, 1 + 2 * WINDOW, H, W), {}, random.key(0)[None], None, 1.0,
                                  cut, Start(image, image, last=last))
    first, second = (cond["framepack_history"] for cond in seen)
    assert torch.equal(first[:, :, :1], image) and torch.equal(first[:, :, 1:2], last) and not first[:, :, 2:].any()
    assert torch.equal(second[:, :, 1:1 + WINDOW], torch.ones(1, C, WINDOW, H, W))  # the section made after it
    assert not second[:, :, 1 + WINDOW:].any() and made.shape[2] == 1 + 2 * WINDOW


def test_a_last_image_averages_the_image_features_and_is_encoded_as_the_start_is():
    """The pipeline's image features with a last image: ``(features(image) + features(last)) / 2``."""
    class Encoder:
        def encode_image(self, pixels):  # [3, H, W] in [0, 1] -> [1, 2]: its mean, twice
            return pixels.mean().reshape(1, 1).repeat(1, 2)

        def encode_video(self, video):  # [3, 1, H, W] -> [C, 1, h, w]: its mean
            return video.mean().reshape(1, 1, 1, 1).expand(C, 1, H, W).clone()

    class Model:
        latents = type("Space", (), {"vae_stride": (4, 8, 8)})()
        cond = {"image_embeds": (1, 2)}

        @staticmethod
        def normalize(x):
            return 2 * x

    dark, light = numpy.zeros((1, 8 * H, 8 * W, 3), numpy.uint8), numpy.full((1, 8 * H, 8 * W, 3), 255, numpy.uint8)
    cut = SectionsConfig(window=WINDOW)
    extra, start = sample_inputs.section_condition(Encoder(), dark, (C, 1 + WINDOW, H, W), Model(), cut, light)
    numpy.testing.assert_allclose(extra["image_embeds"], [[0.5, 0.5]], atol=1e-6)
    assert torch.allclose(start.image, torch.full_like(start.image, -2.0))  # dark: -1, normalised
    assert torch.allclose(start.last, torch.full_like(start.last, 2.0))


def pipeline_video_histories(prefix, video, chunks_made):
    """``HeliosPipeline(video=...)``'s histories, written out (``pipeline_helios.py``: the 19 zero frames replaced by
    the noised video latents, left-padded when shorter; every chunk's prefix the noised first frame; each chunk
    appended): the ``framepack_history`` each new chunk sees, in fvx's layout (first, 1x, 2x, 4x)."""
    frames = video.shape[2]
    history = video if frames >= 19 else torch.cat([torch.zeros(1, C, 19 - frames, H, W), video], dim=2)
    seen = []
    for chunk in chunks_made:
        long, mid, short = history[:, :, -19:].split([16, 2, 1], dim=2)
        seen.append(torch.cat([prefix, short, mid, long], dim=2))
        history = torch.cat([history, chunk], dim=2)
    return seen


@pytest.mark.parametrize("chunks", [1, 10])  # a video shorter than the history, and one longer
def test_helios_chunks_after_a_video_see_the_pipelines_history(monkeypatch, chunks):
    seen = []

    def draw(sampler, noise, cond, keys, uncond, guidance):
        seen.append(cond)
        return torch.full_like(noise, float(len(seen))), None

    monkeypatch.setattr(validation, "draw", draw)
    prefix, video = torch.randn(1, C, 1, H, W), torch.randn(1, C, chunks * WINDOW, H, W)
    start, keys = Start(prefix, None, noised=True, given=video), random.key(5)[None]
    cut = sample_inputs.made_cut(SectionsConfig(window=WINDOW, order="chunks"), video)
    total = 1 + (chunks + 2) * WINDOW  # the first frame's slot, the video's chunks, two new ones
    made = sampling.draw_sections(None, torch.zeros(1, C, total, H, W), {}, keys, None, 1.0, cut, start)
    noised = sample_inputs.noised_start(start, keys)
    new = [torch.full((1, C, WINDOW, H, W), float(n + 1)) for n in range(2)]
    want = pipeline_video_histories(noised.image, noised.given, new)
    assert len(seen) == 2 and all(torch.equal(cond["framepack_history"], history)
                                  for cond, history in zip(seen, want))
    assert torch.equal(made, torch.cat([video, *new], dim=2))  # the given chunks as given, then the new ones


def test_each_frame_of_a_given_video_is_noised_at_its_own_level():
    video = torch.ones(1, 4, 3, 64, 64)
    noised = sample_inputs.noised_start(Start(torch.ones(1, 4, 1, 64, 64), None, noised=True, given=video),
                                        random.key(0)[None])
    spread = [noised.given[0, :, f].std().item() for f in range(3)]
    assert noised.before is None and all(0.105 < s < 0.141 for s in spread) and len(set(spread)) == 3
