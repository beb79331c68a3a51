"""SANA-Video: a linear-attention flow DiT on the Wan 2.1 VAE's latents. Its forward against the diffusers module as
SanaVideoPipeline calls it is the family test's (tests/fvx_models/test_families.py, case "sana_video"); its LoRA
loads with SanaVideoPipeline (tests/fvx_models/test_lora.py). Here: its encoders are the pipeline's prompt encoding
(the complex human instruction, 300 kept tokens) and the Wan VAE's mean, the released preset, the exported folder."""
import inspect
import json
import string

import torch
import transformers
from diffusers import AutoencoderKLWan, DPMSolverMultistepScheduler, SanaVideoPipeline, SanaVideoTransformer3DModel

import encoder_checks
from fvx.core import random
from fvx_models import sana_video, wan
from fvx_models.sana_video import SanaVideoConfig


def tiny_gemma_folder(path):
    """A SanaVideoPipeline folder (transformer left out): Gemma-2 of width 16 over a tokenizer of single characters,
    a tiny Wan VAE."""
    symbols = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "▁", "\n"] + list(string.printable[:94])
    tokenizer = transformers.GemmaTokenizerFast(vocab={s: i for i, s in enumerate(dict.fromkeys(symbols))}, merges=[])
    torch.manual_seed(0)
    text = transformers.Gemma2Model(transformers.Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=4096))
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True])
    SanaVideoPipeline(tokenizer=tokenizer, text_encoder=text, vae=vae, transformer=None,
                      scheduler=DPMSolverMultistepScheduler()).save_pretrained(path)
    return path


def test_text_is_the_pipelines_prompt_encoding_cut_to_its_mask_and_video_the_vaes_mean(tmp_path):
    opened = sana_video.ENCODERS.open(tiny_gemma_folder(tmp_path), ["text", "video"])
    assert type(opened.pipe) is SanaVideoPipeline
    prompts = ["red bars moving left", "a cat"]
    rows = opened.encode_text(prompts)
    embeds, mask, _, _ = opened.pipe.encode_prompt(
        prompts, do_classifier_free_guidance=False, max_sequence_length=300,
        complex_human_instruction=sana_video.COMPLEX_HUMAN_INSTRUCTION)
    assert embeds.shape[1] == 300 and [len(r) for r in rows] == mask.sum(1).tolist()
    for row, full, keep in zip(rows, embeds, mask):
        assert torch.equal(row, full[keep.bool()]) and keep[:len(row)].all()  # the kept rows come first
    video = encoder_checks.random_clip((3, 5, 16, 16))
    assert torch.equal(opened.encode_video(video), opened.pipe.vae.encode(video[None]).latent_dist.mode()[0])


def test_the_released_preset_is_the_converted_2b_480p():
    """diffusers' scripts/convert_sana_video_to_diffusers.py at 480p: 20 blocks of 20 x 112, Gemma-2-2B's 2304-wide
    captions, patch 1 x 2 x 2 on the Wan 2.1 VAE, flow shift 8."""
    preset = SanaVideoConfig(preset="sana-video-2b-480p").spec
    signature = [name for name in inspect.signature(SanaVideoTransformer3DModel.__init__).parameters if name != "self"]
    assert sorted(preset.kwargs) == sorted(signature)
    k = preset.kwargs
    assert (k["num_layers"], k["num_attention_heads"], k["attention_head_dim"], k["caption_channels"]) == (
        20, 20, 112, 2304)
    assert (k["sample_size"], k["patch_size"], k["mlp_ratio"]) == (30, (1, 2, 2), 3.0)
    assert preset.latents == wan.WAN21_VAE and preset.options["flow_shift"] == 8.0


def test_an_export_is_a_sana_video_pipeline_folder(tmp_path):
    model = SanaVideoConfig(preset="tiny").build()
    params = model.weights.init(random.key(0))
    written = model.export.folder(params, str(tmp_path))
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "SanaVideoPipeline" and index["vae"] == ["diffusers", "AutoencoderKLWan"]
    scheduler = DPMSolverMultistepScheduler.from_pretrained(tmp_path / "scheduler").config
    assert (scheduler.flow_shift, scheduler.prediction_type, scheduler.use_flow_sigmas) == (3.0, "flow_prediction",
                                                                                            True)
    loaded = SanaVideoTransformer3DModel.from_pretrained(written.files["transformer"])
    assert all(torch.equal(p, params[name]) for name, p in loaded.state_dict().items() if name in params)
