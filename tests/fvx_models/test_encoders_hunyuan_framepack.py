"""FramePack's encoders (fvx_models.hunyuan_framepack.ENCODERS): HunyuanVideo's text and VAE, and SigLIP's features
of the start frame from a tiny random HunyuanVideoFramepackPipeline folder, as the pipeline's encode_image makes them
and as musubi-tuner's caching makes them (the processor on the uint8 frame)."""
import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from diffusers import HunyuanVideoFramepackPipeline

from fvx_models import hunyuan_framepack
from test_encoders_hunyuan_video import tiny_components


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    siglip = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
        patch_size=8))
    processor = transformers.SiglipImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.5] * 3,
                                                  image_std=[0.5] * 3, resample=3)
    pipe = HunyuanVideoFramepackPipeline(**tiny_components(), image_encoder=siglip, feature_extractor=processor)
    path = tmp_path_factory.mktemp("framepack")
    pipe.save_pretrained(path)
    return path


def test_the_start_frames_features_are_siglips_as_the_pipeline_and_musubi_tuner_make_them(folder):
    opened = hunyuan_framepack.ENCODERS.open(folder, ["image"])
    y, x = np.mgrid[:48, :40]
    pixels = np.stack([128 + 100 * np.sin(y / 7 + c) * np.cos(x / 9) for c in range(3)], -1).round().astype(np.uint8)
    frame = torch.from_numpy(pixels).permute(2, 0, 1).float() / 255
    features = opened.encode_image(frame)
    pipe = opened.pipe
    with torch.no_grad():
        assert torch.equal(features, pipe.encode_image(frame[None] * 2 - 1)[0])
        musubi = pipe.image_encoder(**pipe.feature_extractor.preprocess(images=pixels, return_tensors="pt"))
    assert features.shape == (16, 16)  # (32 / 8)^2 patches of SigLIP's width
    # the processor resizes 8-bit pictures: the pipeline's [-1, 1] round trip moves a few pixels one level
    torch.testing.assert_close(features, musubi.last_hidden_state[0], rtol=0, atol=0.05)


def test_a_folder_without_the_image_encoder_is_refused_in_one_line(folder, tmp_path):
    index = json.loads((folder / "model_index.json").read_text())
    (tmp_path / "model_index.json").write_text(json.dumps({**index, "image_encoder": [None, None]}))
    shutil.copytree(folder / "feature_extractor", tmp_path / "feature_extractor")
    with pytest.raises(ValueError, match=r"has no 'image_encoder' component \(in model_index.json and an? "
                                         r"image_encoder/ folder\), which image encoding needs$") as error:
        hunyuan_framepack.ENCODERS.open(tmp_path, ["image"])
    assert "\n" not in str(error.value)
