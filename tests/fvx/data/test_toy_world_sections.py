"""The toy world cut into sections (fvx.data.toy_world_sections): a sample is a section of its clip, scored against
the clip's true frames when it is given frames, against the nearest of its prompt's clips when it is given none
(Helios's first chunk)."""
import torch

from fvx.core import random
from fvx.data import sections
from fvx.data.sections import SectionsConfig
from fvx.data.toy_world import Codec, WorldConfig
from fvx.data.toy_world_sections import SectionWorldDataset

WORLD = WorldConfig(num_samples=32, frames=4, factor=4)


def world(order: str) -> SectionWorldDataset:
    return SectionWorldDataset(WORLD, random.key(0), kind="framepack", collate=lambda samples, indices: samples,
                               sections=SectionsConfig(window=2, order=order))


def test_samples_are_their_clips_sections_every_prompt_every_section():
    data = world("chunks")
    prompts = len(data.prompts)
    assert [data.section(i) for i in (0, prompts - 1, prompts, 2 * prompts)] == [0, 0, 1, 0]
    sample = data.sample(prompts)  # section 1 of clip P: frames 2, 3, given frames 0, 1
    full = data.clip(prompts)
    part = sections.cut(torch.from_numpy(Codec(4).encode(torch.from_numpy(full)[None] / 2 + 0.5)[0].numpy()),
                        data.sections)[1]
    assert torch.equal(torch.from_numpy(sample["latents"]), part["latents"])
    assert torch.equal(torch.from_numpy(sample["framepack_history"]), part["history"])


def test_a_section_given_frames_is_scored_against_its_clip_and_one_given_none_against_the_nearest():
    data = world("chunks")
    prompts = len(data.prompts)
    truth = [torch.from_numpy(data.clip(i))[None] / 2 + 0.5 for i in range(3 * prompts)]
    other_phase = next(i for i in range(prompts, 3 * prompts, prompts) if not torch.equal(truth[i], truth[0]))
    # sample 0: a first chunk (frames 0, 1), given nothing: another clip of its prompt is as right as its own
    assert data.sample_quality(truth[other_phase][:, :, :2], [0])["section_mse"] == 0.0
    # sample P: the second chunk of clip P (frames 2, 3), given frames 0, 1: only its own clip's frames are right
    assert data.sample_quality(truth[prompts][:, :, 2:], [prompts]) == {"section_mse": 0.0, "hit_rate": 1.0}
    wrong = next(i for i in range(0, 3 * prompts, prompts)
                 if not torch.equal(truth[i][:, :, 2:], truth[prompts][:, :, 2:]))
    assert data.sample_quality(truth[wrong][:, :, 2:], [prompts])["section_mse"] > 0.01
