"""fvx_models.wan_moe: Wan 2.2 A14B fine-tuned one expert per step, as FastVideo's trainer picks it
(``fastvideo/training/training_pipeline.py:311-343``): the low-noise ``transformer_2`` when the step's uniform draw is
``<= boundary_ratio``, else the high-noise ``transformer``, each at its own timesteps (the router's split at
``1000 boundary_ratio``)."""
import math

import pytest
import torch

from fvx.core import flow, random
from fvx.core.optim_config import AdamWConfig
from fvx_methods import finetune
from fvx_models import lora
from fvx_models.model import StepRange
from fvx_models.wan_moe import Wan22MoEConfig

BOUNDARY = 0.875  # the tiny T2V preset's, Wan 2.2 T2V A14B's
HIGH_LEVELS = 126  # levels 0..125 of the unshifted 1000-level grid have t = 1000..875: the high-noise expert's


def expert_of_step(step_key: torch.Tensor, boundary: float = BOUNDARY) -> str:
    """FastVideo's rule on fvx's step draw: the low-noise expert when ``uniform(step_key) <= boundary_ratio``."""
    return "transformer_2" if random.uniform(step_key, ()).item() <= boundary else "transformer"


def step_draw(step_key: torch.Tensor, size: int = 3, shift: float = 1.0):
    """The step's ``(sigma, t, u)`` as fine-tuning draws them for the tiny A14B, with each sample's uniform ``u``."""
    ranges = Wan22MoEConfig(preset="tiny").family.training.step_ranges(Wan22MoEConfig(preset="tiny"))
    _, t_keys = flow.per_sample_noise(step_key, torch.arange(size), (1,), torch.device("cpu"))
    sigma, t = finetune.step_range_sigmas(step_key, t_keys, ranges, finetune.Finetune(flow_shift=shift),
                                          torch.device("cpu"))
    return sigma, t, flow.sample_u(t_keys, "uniform")


def test_the_experts_ranges_are_the_routers_split_with_fastvideos_probabilities():
    config = Wan22MoEConfig(preset="tiny")
    ranges = config.family.training.step_ranges(config)
    assert ranges == (StepRange(0.875, 0.0, 875.0), StepRange(0.125, 875.0, math.inf))
    i2v = Wan22MoEConfig(preset="tiny-i2v")
    assert i2v.family.training.step_ranges(i2v) == (StepRange(0.9, 0.0, 900.0), StepRange(1.0 - 0.9, 900.0, math.inf))
    one = Wan22MoEConfig(preset="tiny", trainable=("transformer",))
    assert one.family.training.step_ranges(one) == (StepRange(1.0, 875.0, math.inf),)  # one trained expert: every step


def test_each_step_draws_one_expert_as_fastvideo_and_every_sample_on_its_levels():
    """Over 40 steps: every sample of a step is in the expert that FastVideo's rule picks from the step key, at the
    level ``first + floor(u count)`` of that expert's levels on the unshifted grid (t = 1000 - index); over 2000
    step keys that rule picks the high-noise expert in ``1 - boundary_ratio`` of the steps, as FastVideo's does."""
    chosen = []
    for step in range(40):
        key = random.fold_in(random.key(5), step)
        sigma, t, u = step_draw(key)
        chosen.append(expert_of_step(key))
        first, count = (0, HIGH_LEVELS) if chosen[-1] == "transformer" else (HIGH_LEVELS, 1000 - HIGH_LEVELS)
        index = first + torch.floor(u * count).long()
        assert torch.equal(sigma, (1000 - index).float() / 1000)
        assert torch.equal(t, sigma * 1000)
        assert bool((t >= 875).all()) if chosen[-1] == "transformer" else bool((t < 875).all())
    assert set(chosen) == {"transformer", "transformer_2"}
    steps = 2000
    draws = flow.sample_u(random.fold_in(random.key(6), torch.arange(steps)), "uniform")  # uniform(step_key) each
    highs = float((draws > BOUNDARY).float().mean())
    assert abs(highs - (1 - BOUNDARY)) < 4 * math.sqrt(BOUNDARY * (1 - BOUNDARY) / steps)


def test_a_grid_with_no_level_in_an_experts_range_is_refused():
    model = Wan22MoEConfig(preset="tiny").build()
    with pytest.raises(ValueError, match=r"method.flow_shift=1000000.0: the training grid has no level in model "
                                         r"wan_moe:tiny's step range 0.0 <= t < 875.0"):
        finetune.Finetune(flow_shift=1e6).build({"student": model}, total_steps=1)


def test_fine_tuning_trains_exactly_the_steps_expert():
    """Eight fine-tuning steps of the tiny A14B: each step's gradient is exactly zero on one expert and not on the
    other, the one FastVideo's rule picks from the step key (both experts occur). fvx keeps one AdamW over both
    experts, so the idle one still moves by its momentum and decay (FastVideo steps only the chosen expert's
    optimizer: see the design note)."""
    model = Wan22MoEConfig(preset="tiny").build()
    seen = []

    def before_update(name, grads, params):
        seen.append({expert: any(bool(g.abs().sum() > 0) for n, g in grads.items() if n.startswith(f"{expert}."))
                     for expert in ("transformer", "transformer_2")})

    program = finetune.Finetune(flow_shift=1.0, optim=AdamWConfig(lr=1e-3)).build(
        {"student": model}, total_steps=8, before_update=before_update)
    state, frozen = program.init(random.key(2)), program.frozen(random.key(2))
    g = torch.Generator().manual_seed(0)
    batch = {"latents": torch.randn(2, 16, 1, 4, 4, generator=g), "sample_index": torch.arange(2),
             "cond": {"text": torch.randn(2, 8, 32, generator=g), "text_mask": torch.ones(2, 8)}}
    chosen = []
    for step in range(8):
        chosen.append(expert_of_step(random.fold_in(state.key, state.step)))
        state, _ = program.step_(state, frozen, {**batch, "sample_index": batch["sample_index"] + 2 * step})
    assert set(chosen) == {"transformer", "transformer_2"}
    assert seen == [{expert: expert == pick for expert in ("transformer", "transformer_2")} for pick in chosen]


def test_lora_adapts_only_the_trainable_experts():
    """``trainable`` names the experts that train; with LoRA the others get no adapters (their layers stay as
    loaded), so a step never updates the expert the config holds."""
    both = Wan22MoEConfig(lora=lora.LoRAConfig(rank=2)).build().weights.trained_names
    low = Wan22MoEConfig(trainable=("transformer_2",), lora=lora.LoRAConfig(rank=2)).build().weights.trained_names
    assert {name.split(".")[0] for name in both} == {"transformer", "transformer_2"}
    assert low == {name for name in both if name.startswith("transformer_2.")}
