"""The training noise levels of every fine-tuning recipe, against its source trainer's formula (issue 40).

For each named recipe whose method is fine-tuning, N levels are drawn with fvx's own path, the function the loss
draws with (``fvx_methods.finetune.draw_sigmas``), given the recipe's method and what the built model carries for it
(its family's ``sigma_sampler`` bound to the recipe's model config, as ``fvx_models.build`` binds it; the real models
are 2B-14B, so no model is built: :func:`test_a_built_model_draws_what_its_family_sampler_draws` checks the binding on
tiny ones), on latents of the recipe's shape (zeros, expanded: only the shape is read). The source's formula
is written out here from the trainer's code (file and lines in each entry of :data:`SOURCES`) and sampled with
torch's own RNG, so nothing of fvx's draw is shared. The two agree when each of fvx's quantiles sits where the source's
distribution puts that probability: ``|F_source(q-quantile of fvx's draws) - q| <= TOLERANCE`` for the quantiles in
:data:`QUANTILES`. A shifted grid, a mirrored density or a wrong token count moves the median by far more (LTX-Video's
old recipe: 0.118 against 0.884; Wan I2V's shift 3: 0.75 against 0.5).
"""
import functools
import math
import pathlib
import types
from typing import Callable

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from fvx import config as fconfig
from fvx.core import random, tree
from fvx_methods import finetune
from fvx_models.ltx2 import LTX2Config
from fvx_models.ltx_video import LTXVideoConfig
from fvx_models.minimax_h3 import MiniMaxH3Config
from fvx_models.model import Rules

N = 1024  # fvx's draws per recipe (the grid's per-key draws take ~2 ms each on a loaded 2-core CPU)
N_SOURCE = 200_000  # the source formula's draws
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
TOLERANCE = 0.06  # in probability; the q-quantile of N draws is off by sqrt(q (1 - q) / N) <= 0.016 (one sd)
EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"

Draw = Callable[[torch.Generator, int], "torch.Tensor | dict[str, torch.Tensor]"]


# ---------------------------------------------------------------------------------------- the sources' formulas


def fastvideo_grid(shift: float) -> Draw:
    """FastVideo's fine-tuning draw, its default ``weighting_scheme`` uniform: ``u ~ U[0, 1)``, the level at index
    ``floor(1000 u)`` of ``FlowMatchEulerDiscreteScheduler(shift=shift)``'s descending training sigmas
    (``fastvideo/train/models/wan/wan.py:462-481`` and ``get_sigmas``, for Wan and the plugins that subclass it;
    ``fastvideo/training/training_pipeline.py:311-343`` in the legacy pipelines)."""
    sigmas = FlowMatchEulerDiscreteScheduler(shift=shift).sigmas.float()

    def draw(generator: torch.Generator, n: int) -> torch.Tensor:
        u = torch.rand(n, generator=generator)
        return sigmas[(u * 1000).long()]
    return draw


def musubi_shift(shift: float) -> Draw:
    """musubi-tuner's ``--timestep_sampling shift`` at ``--sigmoid_scale`` 1: ``t = sigmoid(N(0, 1))``, shifted ``s t /
    (1 + (s - 1) t)`` (``training/trainer_base.py:589-612``), continuous; sigma is that ``t``."""
    def draw(generator: torch.Generator, n: int) -> torch.Tensor:
        t = torch.randn(n, generator=generator).sigmoid()
        return shift * t / (1 + (shift - 1) * t)
    return draw


def helios_stage1(generator: torch.Generator, n: int) -> torch.Tensor:
    """Helios's stage-1 draw (``helios/utils/utils_helios_base.py:737-770``, ``train_helios.py:260-261``): ``u ~
    sigmoid(N(0, 1))`` (its logit-normal weighting), the level at index ``floor(1000 u)`` of
    ``FlowMatchEulerDiscreteScheduler(1000, shift=1)``'s sigmas."""
    sigmas = FlowMatchEulerDiscreteScheduler(shift=1.0).sigmas.float()
    return sigmas[(torch.randn(n, generator=generator).sigmoid() * 1000).long()]


def diffsynth_wan(shift: float, boundaries: tuple[float, float] = (0.0, 1.0)) -> Draw:
    """DiffSynth-Studio's Wan training draw (``diffsynth/diffusion/loss.py`` ``FlowMatchSFTLoss``): an index
    ``randint(int(min 1000), int(max 1000))`` (its ``--min/max_timestep_boundary``, lines 11-14) into
    ``FlowMatchScheduler("Wan")``'s 1000 training levels, ``linspace(1, 0, 1001)[:-1]`` shifted ``s u / (1 + (s - 1)
    u)`` (``flow_match.py`` ``set_timesteps_wan``); its loss weight is apart (``Finetune.loss_weighting=bell``)."""
    u = torch.linspace(1, 0, 1001)[:-1]
    sigmas = shift * u / (1 + (shift - 1) * u)
    low, high = (int(b * 1000) for b in boundaries)

    def draw(generator: torch.Generator, n: int) -> torch.Tensor:
        return sigmas[torch.randint(low, high, (n,), generator=generator)]
    return draw


def hunyuan_video15_release(generator: torch.Generator, n: int) -> torch.Tensor:
    """HunyuanVideo-1.5's ``train.py`` at its defaults (snr_type lognorm, train_timestep_shift 3): ``t = sigmoid(N(0,
    1)) (1 - 2e-5) + 1e-5`` (``TimestepSampler.sample``, lines 228-239), shifted ``3 t / (1 + 2 t)``
    (``timestep_transform``, 269-275, applied at 751-752), continuous; sigma is that ``t``."""
    t = torch.sigmoid(torch.randn(n, generator=generator)) * (1 - 2e-5) + 1e-5
    return 3 * t / (1 + 2 * t)


def ltx_video_trainer(tokens: int) -> Draw:
    """LTX-Video-Trainer's ``ShiftedLogitNormalTimestepSampler`` (``src/ltxv_trainer/timestep_samplers.py:63-113``),
    its default ``timestep_sampling_mode`` with std 1: ``sigma = sigmoid(N(mu, 1))``, ``mu = m tokens + b`` through
    (1024, 0.95) and (4096, 2.05), ``tokens`` the packed sequence length (``sample_for``)."""
    slope = (2.05 - 0.95) / (4096 - 1024)
    mu = slope * tokens + 0.95 - slope * 1024

    def draw(generator: torch.Generator, n: int) -> torch.Tensor:
        return torch.sigmoid(torch.randn(n, generator=generator) + mu)
    return draw


def fastvideo_ltx2(tokens: int, uniform_prob: float = 0.1) -> Draw:
    """FastVideo's LTX-2 plugin, ``_sample_ltx2_sigmas`` (``fastvideo/train/models/ltx2/ltx2.py:422-470``, constants
    at 65-74, ``timestep_uniform_prob`` default 0.1): ``s = sigmoid(N(mu, 1))``, ``mu`` as LTX-Video's, stretched
    between ``sigmoid(mu - 2.5758)`` and ``sigmoid(mu + 3.0902)``, reflected below 1e-3, clamped to [0, 1], and
    replaced by U(1e-3, 1) with probability ``uniform_prob``."""
    slope = (2.05 - 0.95) / (4096 - 1024)
    mu = slope * tokens + 0.95 - slope * 1024
    lo, hi = 1 / (1 + math.exp(-(mu - 2.5758))), 1 / (1 + math.exp(-(mu + 3.0902)))

    def draw(generator: torch.Generator, n: int) -> torch.Tensor:
        raw = (torch.sigmoid(torch.randn(n, generator=generator) + mu) - lo) / (hi - lo)
        stretched = torch.where(raw >= 1e-3, raw, 2e-3 - raw).clamp(0.0, 1.0)
        coin = torch.rand(n, generator=generator)
        uniform = torch.rand(n, generator=generator) * (1 - 1e-3) + 1e-3
        return torch.where(coin > uniform_prob, stretched, uniform)
    return draw


def fastvideo_minimax_h3(generator: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """FastVideo's MiniMax-H3 plugin (``fastvideo/train/models/minimax_h3/minimax_h3.py:205-225``, shifts at 37-38):
    one stage ``b ~ U[0, 1)`` per sample, video ``12 b / (1 + 11 b)``, audio ``3 b / (1 + 2 b)``."""
    b = torch.rand(n, generator=generator)
    return {"video": 12 * b / (1 + 11 * b), "audio": 3 * b / (1 + 2 * b)}


WAN = fastvideo_grid(3.0)  # WanModel(flow_shift=3.0), the default of models.student.flow_shift (wan.py:69, 94); a
# YAML's pipeline.flow_shift is its validation pipeline's, which WanModel does not read (train/utils/builder.py:33)

SOURCES: dict[str, Draw] = {
    "finetune_cosmos.py:cosmos25_t2w_2b": fastvideo_grid(1.0),  # CosmosModel(flow_shift=1.0), cosmos.py:58
    "finetune_cosmos.py:overfit_cosmos25_t2w": fastvideo_grid(1.0),  # models.student.flow_shift: 1.0 (its YAML:18)
    "finetune_framepack.py:musubi_framepack_lora": musubi_shift(3.0),  # docs/framepack.md: --discrete_flow_shift 3.0
    "finetune_helios.py:helios_stage1": helios_stage1,  # scripts/training/configs/stage_1_init.yaml
    "finetune_wan_animate.py:diffsynth_animate_lora": diffsynth_wan(5.0),  # its Wan template's default shift 5
    # the high-noise runs of its Wan2.2-VACE-Fun-A14B scripts: --max_timestep_boundary 0.358
    **{f"finetune_wan_vace.py:diffsynth_vace_fun_a14b_{kind}": diffsynth_wan(5.0, (0.0, 0.358))
       for kind in ("lora", "full")},
    "finetune_hunyuan_video15.py:release_480p_t2v": hunyuan_video15_release,
    "finetune_kandinsky5.py:kandinsky5_t2v_480p_qat": fastvideo_grid(5.0),  # Kandinsky5Model(flow_shift=5.0), :89
    **{f"finetune_ltx2.py:{name}": fastvideo_ltx2(11 * 15 * 26)  # 81 frames of 480x832: its YAMLs' num_latent_t 11
       for name in ("ltx2_t2v", "ltx2_t2v_lora", "ltx2_3_t2v", "ltx2_3_t2v_lora", "ltx2_overfit", "ltx2_3_overfit",
                    "ltx2_t2v_nvfp4_qat", "ltx2_3_t2v_nvfp4_qat", "ltx2_overfit_nvfp4_qat")},
    "finetune_ltx2.py:world_nvfp4_qat": fastvideo_ltx2(1),  # the toy world's default: latents as drawn() shapes them
    "finetune_ltx_video.py:ltxv_2b_lora": ltx_video_trainer(12 * 14 * 24),  # its bucket 768x448x89: 4032 tokens
    "finetune_minimax_h3.py:minimax_h3_t2va_overfit": fastvideo_minimax_h3,
    "finetune_wan.py:wan21_t2v_1p3b": WAN,  # fine_tuning/wan/t2v.yaml
    "finetune_wan.py:wan21_t2v_1p3b_vsa": WAN,  # t2v_vsa.yaml
    "finetune_wan.py:world_attn_qat": WAN,  # the QAD scenario's stage 1 on the toy world: its trainer's default
    "finetune_wan.py:wan21_t2v_1p3b_attn_qat": WAN,  # scenario/qad_wan2_1_mixkit/stage1_attn_qat_finetune.yaml
    "finetune_wan.py:world_vsa": WAN,  # t2v_vsa.yaml on the toy world
    # the legacy I2V pipeline replaces its shift-3 scheduler by diffusers' FlowMatchEulerDiscreteScheduler() (shift 1)
    # in TrainingPipeline.train before the first step (fastvideo/training/training_pipeline.py:536)
    "finetune_wan_i2v.py:wan21_i2v_14b_480p": fastvideo_grid(1.0),
    "finetune_wan_i2v.py:wan21_i2v_14b_480p_lora": fastvideo_grid(1.0),
    "finetune_wan_lora.py:wan21_t2v_1p3b": WAN,  # t2v_lora.yaml
    "finetune_wan_lora.py:fastwan21_t2v_1p3b_vsa": WAN,  # fast_t2v_lora_vsa.yaml
    "finetune_wan22_ti2v.py:fastwan22_ti2v_5b_fullattn_lora_vsa": WAN,  # fast_ti2v_fullattn_lora_vsa.yaml
    "finetune_wan_lora.py:turbowan21_t2v_1p3b_lora_sla": WAN,  # turbo_t2v_lora_sla.yaml
    "finetune_wan_lora.py:world_lora_sla": WAN,  # turbo_t2v_lora_sla.yaml on the toy world
    # MatrixGame2Model is FastVideo's Wan plugin: its flow_shift 3 (fastvideo/train/models/wan/wan.py:69,94)
    "worldmodel_matrixgame2.py:zelda_finetune_i2v": WAN,  # scenario/worldmodel/zelda/finetune_i2v.yaml
    "worldmodel_matrixgame2.py:solaris_finetune_i2v": WAN,  # scenario/worldmodel/solaris/finetune_i2v.yaml
}
"""Each fine-tuning recipe's source formula: FastVideo's plugin or legacy pipeline, or the model trainer it names."""



# ------------------------------------------------------------------------------------------------ fvx's draws


def fine_tuning_recipes() -> dict[str, object]:
    """Every named recipe of the experiment files whose method is fine-tuning: ``"file.py:name"`` -> its config."""
    found = {}
    for path in sorted(EXPERIMENTS.glob("*.py")):
        namespace = fconfig.run_experiment(path)
        for name in fconfig.recipes(namespace):
            config = namespace[name]()
            if isinstance(config.method, finetune.Finetune):
                found[f"{path.name}:{name}"] = config
    return found


@pytest.fixture(scope="module")
def recipes():
    return fine_tuning_recipes()


def drawn(config, n: int = N):
    """``n`` training levels of the recipe ``config`` through ``finetune.draw_sigmas``, one key per sample, on latents
    of its shape (``validation.latent_shape``, its data bucket where it names one; else its latent frames)."""
    model_config = config.models[config.method.roles.student]
    ranges = model_config.family.training.step_ranges(model_config)
    if ranges:  # a model that trains one timestep range per step (two experts): finetune.step_range_sigmas
        keys = random.fold_in(random.key(0), torch.arange(n))
        return finetune.step_range_sigmas(random.key(1), keys, ranges, config.method, torch.device("cpu"))[0]
    # the method's density on its grid: shared by recipes that agree
    if model_config.family.training.sigma_sampler is None:
        return grid_draws(density(config.method), n)
    shape = config.validation.latent_shape or (model_config.spec.latents.channels, config.data.num_latent_t or 1, 1, 1)
    return draws(functools.partial(model_config.family.training.sigma_sampler, model_config), config.method, shape, n)


def draws(sigma_sampler, method: finetune.Finetune, shape: tuple[int, ...], n: int):
    """``finetune.draw_sigmas`` for ``n`` samples of latents ``shape`` with a model as far as the draw reads it:
    its ``sigma_sampler`` (the family's bound to the model config, as ``fvx_models/build.py`` binds it, or None)."""
    keys = random.fold_in(random.key(0), torch.arange(n))
    model = types.SimpleNamespace(rules=Rules(sigma_sampler=sigma_sampler), joint=False)
    sigma, _ = finetune.draw_sigmas(keys, torch.zeros(()).expand(n, *shape), model=model, config=method)
    return sigma


def density(method: finetune.Finetune) -> finetune.Finetune:
    """The fields of ``method`` the grid draw reads (the rest at their defaults, so equal densities compare equal)."""
    return finetune.Finetune(weighting_scheme=method.weighting_scheme, logit_mean=method.logit_mean,
                             logit_std=method.logit_std, mode_scale=method.mode_scale, flow_shift=method.flow_shift)


@functools.lru_cache(maxsize=None)
def grid_draws(method: finetune.Finetune, n: int) -> torch.Tensor:
    return draws(None, method, (1, 1, 1, 1), n)


def source_draws(recipe: str):
    return SOURCES[recipe](torch.Generator().manual_seed(0), N_SOURCE)


def assert_follows(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """fvx's draws ``got`` have the source's quantiles: the source's CDF at each of fvx's quantiles is within
    TOLERANCE of its probability."""
    got, want = got.double(), want.double()
    for q in QUANTILES:
        level = torch.quantile(got, q)
        at = float((want <= level).double().mean())
        assert abs(at - q) <= TOLERANCE, (f"{what}: fvx's {q}-quantile {float(level):.4f} is the source's "
                                          f"{at:.4f}-quantile (source median {float(want.median()):.4f}, fvx's "
                                          f"{float(got.median()):.4f})")


# ------------------------------------------------------------------------------------------------------ tests


def test_every_fine_tuning_recipe_names_its_source_formula(recipes):
    assert sorted(recipes) == sorted(SOURCES)


@pytest.mark.parametrize("config", [LTXVideoConfig(preset="tiny", timestep_std=0.5), LTX2Config(preset="tiny"),
                                    MiniMaxH3Config(preset="tiny")], ids=lambda c: c.family.name)
def test_a_built_model_draws_what_its_family_sampler_draws(config):
    """The binding :func:`draws` stands in for: a built model's ``sigma_sampler`` is its family's with its config."""
    keys, x0 = random.fold_in(random.key(1), torch.arange(8)), torch.zeros(8, config.spec.latents.channels, 2, 4, 4)
    got, want = config.build().rules.sigma_sampler(keys, x0), config.family.training.sigma_sampler(config, keys, x0)
    (got_leaves, got_def), (want_leaves, want_def) = tree.flatten(got), tree.flatten(want)
    assert got_def == want_def and all(torch.equal(a, b) for a, b in zip(got_leaves, want_leaves))


@pytest.mark.parametrize("recipe", SOURCES)
def test_the_drawn_levels_follow_the_source_trainers_formula(recipes, recipe):
    got, want = drawn(recipes[recipe]), source_draws(recipe)
    if isinstance(want, dict):  # a joint model: each modality's levels
        for name in want:
            assert_follows(got[name], want[name], f"{recipe} {name}")
    else:
        assert_follows(got, want, recipe)


def test_the_ltx_video_recipe_draws_the_trainers_median_of_sigmoid_mu(recipes):
    """Issue 40: median within 0.02 of sigmoid(2.03) = 0.884 (the trainer's mu at the bucket's 4032 tokens), where the
    descending-grid lookup drew 1 - sigmoid(N(2.03, 1)) (median 0.118)."""
    sigma = drawn(recipes["finetune_ltx_video.py:ltxv_2b_lora"], n=4096)
    assert abs(float(sigma.median()) - 1 / (1 + math.exp(-2.03))) < 0.02
    assert abs(float(sigma.quantile(0.25)) - 1 / (1 + math.exp(-(2.03 - 0.6745)))) < 0.02  # sigmoid(mu + z_0.25)


@pytest.mark.parametrize("recipe", ["finetune_wan_i2v.py:wan21_i2v_14b_480p",
                                    "finetune_wan_i2v.py:wan21_i2v_14b_480p_lora"])
def test_the_wan_i2v_recipes_draw_uniform_levels_of_mean_one_half(recipes, recipe):
    """FastVideo's legacy I2V training at shift 1: sigma uniform on {0.001, ..., 1} (mean 0.5005); at shift 3 the mean
    was 0.68. Kolmogorov-Smirnov distance to U(0, 1) at most 0.06 (about its 0.1% critical value for 1024 draws)."""
    sigma = drawn(recipes[recipe]).double()
    assert abs(float(sigma.mean()) - 0.5) < 0.03  # 3.3 standard errors
    ranks = torch.arange(1, N + 1, dtype=torch.float64) / N
    assert float((sigma.sort().values - ranks).abs().max()) < 0.06
    assert set(torch.unique(torch.round(sigma * 1000)).long().tolist()) <= set(range(1, 1001))  # the grid's levels
