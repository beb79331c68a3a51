"""The fvx LoRA fine-tuning step against the peer a user would pick: a diffusers ``WanTransformer3DModel`` with a peft
LoRA adapter (``add_adapter``), ``loss.backward()``, ``clip_grad_norm_(foreach=True)`` and
``torch.optim.AdamW(foreach=True)`` on the adapter params.

Same model (Wan, 4 layers of dim 512, 512 video tokens, batch 1), targets (the 32 attention projections), rank 16,
alpha 16, initial adapters (fvx's, copied into peft's), batch, noise and timesteps (both draw them with the same fvx
keys inside their timing); the base in fp32 for both. Timings alternate fvx / peer; peak resident memory above the
set-up state is measured per variant in a fresh process. Then the state bytes of DMD2 with a LoRA student and critic
on the teacher's base against full DMD2 (three roles of the same model), and the frozen bytes each holds.
    python bench/lora.py [--repeats 10]
"""
from __future__ import annotations

import argparse
import gc
import json
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parents[1]))
from common import alternate, current_rss_bytes, peak_rss_bytes, reset_peak_rss  # noqa: E402

import torch  # noqa: E402

from fvx.core import flow, random, role  # noqa: E402
from fvx.core.optim_config import AdamWConfig  # noqa: E402
from fvx.distributed import sharding  # noqa: E402
from fvx_methods import dmd2, finetune  # noqa: E402
from fvx_models import lora, wan  # noqa: E402
from fvx_models.family import Preset  # noqa: E402

wan.PRESETS["bench-lora-4x512"] = Preset({**wan.TINY, "num_layers": 4, "num_attention_heads": 4,
                                          "attention_head_dim": 128, "ffn_dim": 2048, "text_dim": 64,
                                          "rope_max_seq_len": 64}, wan.TINY_VAE, 16)
LATENT, TEXT_LEN, LR = (16, 2, 32, 32), 16, 1e-4  # 2 x 16 x 16 = 512 tokens after the (1, 2, 2) patch
VARIANTS = ("fvx", "fvx_blocks", "peft")  # fvx eager, fvx with compile=blocks, the peer
ADAPTERS = lora.LoRAConfig(rank=16, alpha=16.0, target_modules=("to_q", "to_k", "to_v", "to_out"))


def config(**knobs) -> wan.WanConfig:
    return wan.WanConfig(preset="bench-lora-4x512", frozen_dtype="fp32", **knobs)


def raw_batch() -> dict:
    """One sample as fvx.data.datasets gives it: latents, the text embedding and its mask."""
    g = torch.Generator().manual_seed(0)
    return {"latents": torch.randn(1, *LATENT, generator=g), "sample_index": torch.arange(1),
            "text": torch.randn(1, TEXT_LEN, 64, generator=g), "text_mask": torch.ones(1, TEXT_LEN)}


def build_fvx(compile: str = "none"):
    model = config(lora=ADAPTERS, compile=compile).build()
    method = finetune.Finetune(optim=AdamWConfig(lr=LR, weight_decay=0.0, max_grad_norm=1.0))
    program = method.build({"student": model}, total_steps=1000)
    return model, method, program, program.init(random.key(0)), program.frozen(random.key(0))


def build_peer(base: dict, adapters: dict):
    """diffusers' module with fvx's base, a peft adapter holding fvx's initial A and B, AdamW on the adapters."""
    from peft import LoraConfig

    plain = config()
    module = plain.family.architecture.skeleton(plain)
    module.load_state_dict({n: p.detach().clone() for n, p in base.items()}, assign=True)
    targets = sorted({name.rsplit(".lora_", 1)[0] for name in adapters})
    module.add_adapter(LoraConfig(r=ADAPTERS.rank, lora_alpha=ADAPTERS.alpha, target_modules=targets))
    module.requires_grad_(False)
    lora_params = []
    for name, p in module.named_parameters():
        if ".lora_" in name:
            fvx_name = name.replace(".default", "")
            p.data.copy_(adapters[fvx_name])
            p.requires_grad_(True)
            lora_params.append(p)
    assert len(lora_params) == len(adapters), (len(lora_params), len(adapters))
    return module.train(), lora_params, torch.optim.AdamW(lora_params, lr=LR, weight_decay=0.0, foreach=True)


def peer_loss(module, method, batch, state, step: int) -> torch.Tensor:
    """The fine-tuning loss through the peft-adapted module, with the draws of fvx's step ``step``."""
    key = random.fold_in(state.key, step)
    x0 = batch["latents"]
    noise, t_keys = flow.per_sample_noise(key, batch["sample_index"], tuple(x0.shape[1:]), x0.device)
    sigma, t = flow.sample_training_sigmas(t_keys, flow.training_sigmas(method.flow_shift), method.weighting_scheme)
    x_t = flow.add_noise(x0, noise, sigma)
    cond = batch["cond"]
    v = module(x_t, t, cond["text"] * cond["text_mask"][..., None], return_dict=False)[0]
    return torch.mean((v.float() - (noise - x0)) ** 2)


def peer_step(module, lora_params, optimizer, method, batch, state, step: int) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = peer_loss(module, method, batch, state, step)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(lora_params, 1.0, foreach=True)
    optimizer.step()
    return loss.detach()


def timings(repeats: int) -> dict:
    model, method, program, state, frozen = build_fvx()
    module, lora_params, optimizer = build_peer(frozen["student"], state.roles["student"].params)
    batch = model.batch(raw_batch())
    compiled = build_fvx("blocks")
    holder = {"fvx": state, "fvx_blocks": compiled[3]}
    first = program.step_(holder["fvx"], frozen, batch)
    holder["fvx"] = first[0]
    agree = abs(float(first[1]["loss"]) - float(peer_step(module, lora_params, optimizer, method, batch, state, 0)))

    def fvx_step(name, prog, frozen_params):
        def step():
            holder[name], metrics = prog.step_(holder[name], frozen_params, batch)
            metrics["loss"].item()
        return step

    def peer():
        peer_step(module, lora_params, optimizer, method, batch, holder["fvx"], int(holder["fvx"].step))

    return {"loss_diff_step0": agree, **alternate({"fvx": fvx_step("fvx", program, frozen),
                                                   "fvx_blocks": fvx_step("fvx_blocks", compiled[2], compiled[4]),
                                                   "peft": peer}, repeats=repeats, warmup=2)}


def peak(variant: str, steps: int = 4) -> float:
    """Peak resident MB above the set-up process over ``steps`` steps of one variant (compilation included)."""
    model, method, program, state, frozen = build_fvx("blocks" if variant == "fvx_blocks" else "none")
    batch = model.batch(raw_batch())
    if variant == "peft":
        module, lora_params, optimizer = build_peer(frozen["student"], state.roles["student"].params)
        del program
    gc.collect()
    base = current_rss_bytes()
    reset_peak_rss()
    for i in range(steps):
        if variant == "peft":
            peer_step(module, lora_params, optimizer, method, batch, state, i)
        else:
            state, _ = program.step_(state, frozen, batch)
    return (peak_rss_bytes() - base) / 2**20


def saved_for_backward() -> dict:
    """MB autograd saves for the backward of one forward (params not counted), fvx eager and peft."""
    model, method, program, state, frozen = build_fvx()
    batch = model.batch(raw_batch())
    adapters = {n: p.detach().clone().requires_grad_(True) for n, p in state.roles["student"].params.items()}
    module, lora_params, optimizer = build_peer(frozen["student"], adapters)
    params = {p.untyped_storage().data_ptr() for p in [*frozen["student"].values(), *adapters.values(),
                                                        *module.parameters()]}

    def measure(fn) -> float:
        seen = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(seen.values()) / 2**20

    key = random.fold_in(state.key, 0)
    return {"fvx": measure(lambda: finetune.loss_fn(role.with_trained(frozen["student"], adapters), batch, key,
                                                    model=model, config=method)),
            "peft": measure(lambda: peer_loss(module, method, batch, state, 0))}


def dmd2_state_bytes() -> dict:
    """Bytes of the trained state and of the frozen params of DMD2 with LoRA roles vs full DMD2."""
    out = {}
    for name, student in (("full", config()), ("lora", config(lora=ADAPTERS))):
        models = {"student": student.build(), "teacher": config().build()}
        models["critic"] = models["student"]
        program = dmd2.DMD2(optim=AdamWConfig(lr=1e-4), critic_optim=AdamWConfig(lr=1e-4), ema_decay=0.99).build(
            models, total_steps=10)
        state, frozen = program.init(random.key(0)), program.frozen(random.key(0))
        distinct = {id(params): params for params in frozen.values()}
        out[name] = {"state": sharding.local_bytes(state.roles),
                     "frozen": sum(sharding.local_bytes(params) for params in distinct.values())}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--peak", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant in this process
    args = parser.parse_args()
    if args.peak:
        print(json.dumps({"peak_mb": peak(args.peak)}))
        return
    times = timings(args.repeats)
    peaks = {v: json.loads(subprocess.run([sys.executable, __file__, "--peak", v], check=True, capture_output=True,
                                          text=True).stdout)["peak_mb"] for v in VARIANTS}
    print(f"LoRA fine-tuning step, Wan 4x512, 512 tokens, batch 1, r {ADAPTERS.rank} on the attention projections "
          f"({torch.get_num_threads()} threads); step-0 loss difference {times['loss_diff_step0']:.1e}")
    saved = saved_for_backward()
    print(f"{'':10} {'step s':>9} {'time/peft':>10} {'peak MB':>9} {'peak/peft':>10} {'saved MB':>9} {'saved/peft':>10}")
    for v in VARIANTS:
        kept = f"{saved[v]:9.1f} {saved[v] / saved['peft']:10.2f}" if v in saved else f"{'-':>9} {'-':>10}"
        print(f"{v:10} {times[v]:9.4f} {times[v] / times['peft']:10.2f} {peaks[v]:9.1f} {peaks[v] / peaks['peft']:10.2f} "
              f"{kept}")
    print("peak: resident MB above the set-up process over 4 steps, compilation included; saved: what autograd keeps "
          "for the backward of one forward (params excluded; compiled graphs keep theirs out of sight)")
    sizes = dmd2_state_bytes()
    print("DMD2 state (student + critic + EMA) and frozen params, MB:")
    for name, b in sizes.items():
        print(f"{name:10} state {b['state'] / 2**20:9.1f}   frozen {b['frozen'] / 2**20:9.1f}")
    print(f"{'ratio':10} state {sizes['lora']['state'] / sizes['full']['state']:9.3f}   total "
          f"{sum(sizes['lora'].values()) / sum(sizes['full'].values()):.3f}   (LoRA / full)")


if __name__ == "__main__":
    main()
