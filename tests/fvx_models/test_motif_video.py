"""Motif-Video, text-to-video: its forward against the diffusers module as MotifVideoPipeline calls it is the family
test's (tests/fvx_models/test_families.py, case "motif_video"), its LoRA loads with its transformer's
``load_lora_adapter`` (tests/fvx_models/test_lora.py); here: its encoders are the pipeline's prompt encoding (cut to
the mask) and the Wan VAE's mean, the released preset, the exported folder."""
import inspect
import json
import string

import torch
import transformers
from diffusers import (AutoencoderKLWan, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler, MotifVideoPipeline,
                       MotifVideoTransformer3DModel)
from transformers.models.t5gemma2.configuration_t5gemma2 import T5Gemma2TextConfig

import encoder_checks
from fvx.core import random
from fvx_models import motif_video, wan
from fvx_models.motif_video import MotifVideoConfig


def tiny_folder(path, pipeline=MotifVideoPipeline, **extra):
    """A MotifVideoPipeline folder (transformer left out): T5Gemma-2 of width 16 (its vision tower tiny too) over a
    tokenizer of single characters, a tiny Wan VAE; ``pipeline`` another of its pipelines (``extra``: its other
    components)."""
    symbols = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "▁", "\n"] + list(string.printable[:94])
    tokenizer = transformers.GemmaTokenizerFast(vocab={s: i for i, s in enumerate(dict.fromkeys(symbols))}, merges=[])
    text = T5Gemma2TextConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
                              dropout_rate=0.0)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=8)
    count = len(tokenizer)
    torch.manual_seed(0)
    encoder = transformers.T5Gemma2Encoder(transformers.T5Gemma2EncoderConfig(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=count,
        eoi_token_index=count + 1, image_token_index=count + 2))
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                           latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0])
    pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=encoder, tokenizer=tokenizer,
             transformer=None, guider=ClassifierFreeGuidance(), **extra).save_pretrained(path)
    return path


def test_text_is_the_pipelines_prompt_encoding_cut_to_its_mask_and_video_the_vaes_mean(tmp_path):
    opened = motif_video.ENCODERS.open(tiny_folder(tmp_path), ["text", "video"])
    prompts = ["red bars moving left", "a cat"]
    rows = opened.encode_text(prompts)
    embeds, _, mask, _ = opened.pipe.encode_prompt(prompts, max_sequence_length=512)
    assert embeds.shape[1] == 512 and [len(r) for r in rows] == mask.sum(1).tolist() and len(rows[1]) < len(rows[0])
    assert all(torch.equal(row, full[keep]) for row, full, keep in zip(rows, embeds, mask))
    video = encoder_checks.random_clip((3, 5, 16, 16))
    assert torch.equal(opened.encode_video(video), opened.pipe.vae.encode(video[None]).latent_dist.mode()[0])


def test_the_released_preset_is_diffusers_text_to_video_layout():
    signature = inspect.signature(MotifVideoTransformer3DModel.__init__).parameters
    preset = MotifVideoConfig(preset="motif-video").spec
    assert preset.kwargs == {name: p.default for name, p in signature.items() if name != "self"}
    assert preset.kwargs["in_channels"] == 2 * preset.latents.channels + 1
    assert preset.latents == wan.WAN21_VAE and preset.text_len == 512


def test_an_export_is_a_motif_video_pipeline_folder(tmp_path):
    model = MotifVideoConfig(preset="tiny").build()
    params = model.weights.init(random.key(0))
    written = model.export.folder(params, str(tmp_path))
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "MotifVideoPipeline" and index["vae"] == ["diffusers", "AutoencoderKLWan"]
    assert FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path / "scheduler").config.use_dynamic_shifting
    loaded = MotifVideoTransformer3DModel.from_pretrained(written.files["transformer"])
    assert all(torch.equal(p, params[name]) for name, p in loaded.state_dict().items() if name in params)


def test_image_to_video_encodes_the_first_frame_and_its_siglip_features_as_the_i2v_pipeline(tmp_path):
    """The image features are what ``MotifVideoImage2VideoPipeline``'s first-frame conditioning makes of the frame
    (the text encoder's vision tower through the feature extractor); the first frame's latents, normalised, then zero
    frames."""
    from diffusers import MotifVideoImage2VideoPipeline

    folder = tiny_folder(tmp_path, MotifVideoImage2VideoPipeline,
                         feature_extractor=transformers.SiglipImageProcessor(size={"height": 16, "width": 16}))
    opened = motif_video.ENCODERS.open(folder, ["first_frame", "image"])
    video = encoder_checks.random_clip((3, 5, 16, 16))
    features = opened.encode_image((video[:, 0] + 1) / 2)
    latents = torch.zeros(1, 4, 2, 8, 8)
    with torch.no_grad():
        *_, reference = opened.pipe._prepare_first_frame_conditioning(video.transpose(0, 1)[None], latents, True)
    torch.testing.assert_close(features, reference[0], rtol=0, atol=1e-6)
    assert opened.encode_first_frame(video).shape == (4, 3, 8, 8)  # the tiny VAE's 2x in time
