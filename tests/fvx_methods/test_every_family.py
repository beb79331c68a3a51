"""Every method on every model family (the tiny case of each family and layout): the method takes one step with
finite metrics, or refuses the model before the first step in one line that names it and what it needs (a
block-causal model, a second time input). Left out: KD (it trains from a teacher's trajectory cache, which its own
tests build) and DiffusionNFT (its rewards score decoded videos: the toy world's or CLIP models')."""
import math

import pytest
import torch

from fvx.core import random
from fvx_methods import anyflow, anyflow_pretrain, causal_cd, dfsft, dmd2, finetune, meanflow, scm, self_forcing, \
    streaming_long

from family_cases import CASES, FAMILIES, raw_batch  # noqa: E402

METHODS = {
    "finetune": finetune.Finetune, "dfsft": dfsft.DFSFT, "scm": scm.SCM, "meanflow": meanflow.MeanFlow,
    "anyflow_pretrain": anyflow_pretrain.AnyFlowPretrain, "causal_cd": lambda: causal_cd.CausalCD(cfg_uncond="zero"),
    "dmd2": lambda: dmd2.DMD2(cfg_uncond="zero"), "anyflow": lambda: anyflow.AnyFlow(cfg_uncond="zero"),
    "self_forcing": lambda: self_forcing.SelfForcing(cfg_uncond="zero"),
    "streaming_long": lambda: streaming_long.StreamingLong(cfg_uncond="zero"),
}
REFUSALS = ("not causal", "block-causal", "has no r input")  # what a method may say a plain model lacks


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model = CASES[request.param].config.build()
    return request.param, model, model.batch(raw_batch(model, random.key(1)))


@pytest.mark.parametrize("method_name", list(METHODS))
def test_a_method_steps_on_every_family_or_refuses_it_in_one_line(family, method_name):
    name, model, batch = family
    models = {role: model for role in ("student", "critic", "teacher", "ema")}
    try:
        program = METHODS[method_name]().build(models, total_steps=2)
        program.check(batch)
    except ValueError as error:
        message = str(error)
        assert "\n" not in message and model.name in message and any(r in message for r in REFUSALS), message
        return
    state = program.init(random.key(0))._replace(carry=program.carry(batch))
    state, metrics = program.step_(state, program.frozen(random.key(0)), batch)
    assert int(state.step) == 1
    assert all(math.isfinite(float(v)) for v in metrics.values() if isinstance(v, torch.Tensor) and v.numel() == 1)
