"""MiniMax-H3's encoders (fvx_models.encoders, the record in fvx_models.minimax_h3): a tiny random folder of diffusers'
modular MiniMax-H3 pipeline (a Qwen3-VL conditioner of 51 layers, the fewest that have a layer 50; the video and
audio VAEs), saved by diffusers itself (only ``modular_model_index.json``), opened as preprocessing opens it, against
diffusers' own blocks and calls."""
import pytest
import torch
import transformers
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3ModularPipeline
from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep, encode_vae_condition

import encoder_checks
from fvx_models import minimax_h3

SPECIAL = ["<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
STATS = dict(latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0])
RATE = 160  # the tiny audio VAE's: a hop of 4 samples, 40 latents a second as released


def tiny_tokenizer() -> transformers.Qwen2TokenizerFast:
    """Qwen2's byte-level tokenizer over printable ASCII (no merges: a token a character), Qwen-VL's vision tokens."""
    vocab = {token: i for i, token in enumerate(dict.fromkeys(SPECIAL + [chr(c) for c in range(33, 127)] + ["Ġ"]))}
    tokenizer = transformers.Qwen2TokenizerFast(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL[1:]})
    return tokenizer


def tiny_qwen3_vl(tokenizer) -> transformers.Qwen3VLForConditionalGeneration:
    """Qwen3-VL as released in form (interleaved M-RoPE, grouped KV heads), width 16, 51 text layers."""
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           [("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}
    config = transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=51,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 1, 1],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0],
                           num_position_embeddings=16),
        **ids)
    return transformers.Qwen3VLForConditionalGeneration(config)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    vae = AutoencoderKLMiniMaxH3(  # 17-frame chunks, 3 latents dropped, 4x time, 4x space
        latent_channels=4, block_out_channels=(8, 8, 8), layers_per_block=1, spatial_downsample_factors=(2, 2, 1),
        temporal_downsample_factors=(2, 2, 1), norm_num_groups=4, decoder_num_layers=1, decoder_num_attention_heads=2,
        decoder_attention_head_dim=8, decoder_num_register_tokens=1, **STATS)
    audio_vae = AutoencoderKLMiniMaxH3Audio(
        encoder_dim=4, encoder_rates=(2, 2), latent_dim=16, latent_channels=4, num_attention_heads=2, decoder_dim=8,
        decoder_rates=(2, 2), decoder_kernel_sizes=(4, 4), sampling_rate=RATE, **STATS)
    pipe = MiniMaxH3ModularPipeline()
    pipe.update_components(text_encoder=tiny_qwen3_vl(tokenizer), tokenizer=tokenizer, vae=vae, audio_vae=audio_vae)
    path = tmp_path_factory.mktemp("minimax_h3")
    pipe.save_pretrained(str(path), overwrite_modular_index=True)
    return path


def test_the_config_carries_the_record():
    record = minimax_h3.MiniMaxH3Config.family.encoders
    assert record is minimax_h3.ENCODERS and (record.frame_base, record.frame_step, record.pixel_multiple) == (5, 17, 32)
    assert record.components(["text", "video", "audio"]) == ("tokenizer", "text_encoder", "vae", "audio_vae")


def test_text_is_qwen3_vl_layer_50_of_each_prompt_verbatim(folder):
    assert not (folder / "model_index.json").exists()  # a modular pipeline's folder: its own index only
    opened = minimax_h3.ENCODERS.open(folder, ["text"])
    prompts = ["a red cat", "bars moving left, then right"]
    rows = opened.encode_text(prompts)
    pipe = opened.pipe
    step = MiniMaxH3TextEncoderStep().init_pipeline()  # diffusers' t2va text block, on the same components
    step.update_components(text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer,
                           processor=minimax_h3.TextPresentation())
    for prompt, row in zip(prompts, rows):
        ids = pipe.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert row.shape == (len(ids), 16) and len(ids) == len(prompt)  # a token a character, no special tokens
        assert torch.equal(row, step(prompt=prompt).get("prompt_embeds")[0])
        # transformers' own forward (text-only positions made by the model itself), hidden state 50
        input_ids = torch.tensor([ids])
        states = pipe.text_encoder(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                   output_hidden_states=True).hidden_states
        assert len(states) == 52 and torch.equal(row, states[50][0])
    with pytest.raises(ValueError, match="prompt 1 holds a Qwen3-VL vision token"):
        opened.encode_text(["a cat", "a <|image_pad|> cat"])


def test_video_latents_are_the_normalised_sample_fastvideo_stores(folder):
    opened = minimax_h3.ENCODERS.open(folder, ["video"])
    vae = opened.pipe.vae
    pixels = torch.randint(0, 256, (3, 22, 32, 32), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    video = pixels.float() / 127.5 - 1
    latents = opened.encode_video(video)
    assert latents.shape == (4, 7, 8, 8) and torch.equal(latents, opened.encode_video(video))  # 17 + 5 -> 5 + 2
    imagenet_mean, imagenet_std = (torch.tensor(v).view(3, 1, 1, 1) for v in ([.485, .456, .406], [.229, .224, .225]))
    posterior = vae.encode((((video + 1) / 2 - imagenet_mean) / imagenet_std)[None]).latent_dist  # [0, 1], ImageNet's
    noise = torch.randn(posterior.mean.shape, generator=torch.Generator().manual_seed(42))
    mean, std = (torch.tensor(STATS[k]).view(4, 1, 1, 1) for k in ("latents_mean", "latents_std"))
    expected = (posterior.mean[0] + posterior.std[0] * noise[0] - mean) / std
    assert torch.equal(latents, expected)
    assert not torch.allclose(latents, (posterior.mean[0] - mean) / std, atol=1e-2)  # a draw, not the mean
    # diffusers' recipe for a visual condition (the same draw, rounded to fp16 before normalising)
    condition = encode_vae_condition(vae, pixels[None], opened.pipe.pixel_mean, opened.pipe.pixel_std, 42)[0]
    assert torch.allclose(latents, condition, atol=1e-2, rtol=1e-3)
    with pytest.raises(ValueError, match=r"clips must have 17 n \+ 5 frames .* got 21"):
        opened.encode_video(video[:, :21])


def test_audio_latents_are_the_normalised_mode_of_each_channel(folder):
    opened = minimax_h3.ENCODERS.open(folder, ["audio"])
    waveform = torch.rand(2, 207, generator=torch.Generator().manual_seed(3)) * 2 - 1
    latents = opened.encode_audio(waveform, RATE)
    posterior = opened.pipe.audio_vae.encode(waveform[:, None], return_dict=False)[0]  # stereo as a batch of 2
    rows = (posterior.mode().transpose(1, 2) - torch.tensor(STATS["latents_mean"])) / torch.tensor(STATS["latents_std"])
    assert latents.shape == (2, 4, 52)  # 207 samples padded to 52 hops
    assert torch.allclose(latents, rows.transpose(1, 2), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=f"the audio VAE takes {RATE} Hz audio, got 32000 Hz"):
        opened.encode_audio(waveform, 32000)


def test_a_folder_without_the_text_encoder_is_refused_before_any_weight_loads(folder, tmp_path):
    encoder_checks.assert_refused_without(minimax_h3.ENCODERS, folder, tmp_path, "text_encoder", ("tokenizer",),
                                          "has no 'text_encoder' component", index_file="modular_model_index.json")
