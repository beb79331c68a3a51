"""What one unit of each group of a model family saves for its backward, per token, measured with saved-tensor hooks in
bf16 (eager), and the ``fvx.distributed.memory.BlockActivations`` coefficients that fit it: ``a`` fp32 vectors of width
dim, ``b`` bf16 vectors of width dim and ``f`` bf16 vectors of width ffn_dim per token. Two widths of FFN separate ``b``
from ``f``. A family file states the fitted numbers; tests/fvx_models/test_families.py checks its estimate against this
measurement.

    python bench/activations.py [--family wan|hunyuan_video|cosmos|...]

A family whose FFN width is fixed by its dim (LTX-Video's 4x) gets ``f`` folded into ``b`` (its rows print f = 0).
"""
from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.func import functional_call  # noqa: E402

from fvx.core import random  # noqa: E402
from fvx_models import build  # noqa: E402


def saved_per_group(config, x: torch.Tensor, t: torch.Tensor, cond: dict) -> dict[str, tuple[int, int, int]]:
    """Per unit group: (fp32 bytes, bf16 bytes, tokens) the first unit saves for its backward, bf16 compute, not
    counting its params and inputs. The unit runs alone on the inputs it got inside a forward of the model."""
    model = config.build()
    module = build.skeleton(config)
    dtypes = build.dtypes_for(module, torch.bfloat16)
    params = {n: p.to(dtypes[n]) for n, p in model.weights.init(random.key(0)).items()}
    groups = build.unit_groups(config.family, module)
    captured = {}
    hooks = [module.get_submodule(units[0][:-1]).register_forward_pre_hook(
        lambda _, args, kwargs, name=name: captured.setdefault(name, (args, kwargs)), with_kwargs=True)
        for name, units in groups.items()]
    kwargs, _ = build.native_inputs(config, x.to(torch.bfloat16), t, {k: v.to(torch.bfloat16) if v.is_floating_point()
                                                                      else v for k, v in cond.items()})
    with torch.no_grad():
        functional_call(module, (params, dict(module.named_buffers())), (), kwargs)
    for hook in hooks:
        hook.remove()
    out = {}
    for name, units in groups.items():
        unit = module.get_submodule(units[0][:-1])
        unit_params = {n[len(units[0]):]: p.detach().requires_grad_(p.is_floating_point())
                       for n, p in params.items() if n.startswith(units[0])}
        args, kw = captured[name]
        args = [a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a for a in args]
        kw = {k: v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v
              for k, v in kw.items()}  # blocks that take keyword arguments only (LTX-Video)
        leaves = [*args, *kw.values()]
        inputs = [*unit_params.values(), *[a for a in leaves if isinstance(a, torch.Tensor)],
                  *[t for a in leaves if isinstance(a, tuple) for t in a if isinstance(t, torch.Tensor)]]
        skip = {i.untyped_storage().data_ptr() for i in inputs}
        saved: dict[int, tuple[int, torch.dtype]] = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in skip:
                saved[storage.data_ptr()] = (storage.nbytes(), tensor.dtype)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            functional_call(unit, (unit_params, dict(unit.named_buffers())), tuple(args), kw)
        fp32 = sum(n for n, d in saved.values() if d == torch.float32)
        half = sum(n for n, d in saved.values() if d != torch.float32)
        stream = args[0] if args else kw["hidden_states"]
        tokens = stream.shape[0] * stream.shape[1]  # of its own stream (video; text for a refiner), all samples
        out[name] = (fp32, half, tokens)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="all")
    args = parser.parse_args()
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "helpers"))
    from family_cases import CASES, inputs  # the tests' tiny models and inputs

    for name, case in CASES.items():
        if args.family not in ("all", case.config.family.name) or name.endswith(("-fps", "-ti2v", "-i2v")):
            continue
        rows = {}
        for mlp in (1, 2):
            config = _widened(case.config, mlp)
            model = config.build()
            x, t, cond = inputs(model, random.key(1), frames=4, size=16, text_len=8)
            rows[mlp] = (config, saved_per_group(config, x, t, cond))
        for group, (fp32, half, tokens) in rows[1][1].items():
            dim, ffn = case.config.family.architecture.widths(rows[1][0])[1][group]
            _, ffn2 = case.config.family.architecture.widths(rows[2][0])[1][group]
            half2 = rows[2][1][group][1]
            f = (half2 - half) / (2 * tokens * (ffn2 - ffn)) if ffn2 != ffn else 0.0
            b = (half / (2 * tokens) - f * ffn) / dim
            a = fp32 / (4 * tokens * dim)
            family = case.config.family
            stated = {**family.architecture.activations, **case.config.spec.options.get("activations", {})}[group]
            print(f"{name:16} {group:26} tokens {tokens:5}  fp32 {fp32 / tokens:9.0f} B/token  "
                  f"bf16 {half / tokens:9.0f} B/token  ->  fp32_dim={a:.1f} compute_dim={b:.1f} compute_ffn={f:.1f}"
                  f"  (the family states {stated.fp32_dim}, {stated.compute_dim}, {stated.compute_ffn})")
    return 0


def _widened(config, factor: int):
    """The tiny config with its FFN ``factor`` times as wide (a bench-only preset registered in this process)."""
    family, preset = config.family, config.spec
    kwargs = dict(preset.kwargs)
    for width in ("ffn_dim", "ff_dim", "mlp_ratio"):  # Wan's, Kandinsky 5's, the others'
        if width in kwargs:
            kwargs[width] *= factor
            break
    name = f"{config.preset}-ffn{factor}"
    family.presets[name] = type(preset)(kwargs, preset.latents, preset.text_len, preset.options)
    return type(config)(preset=name)


if __name__ == "__main__":
    sys.exit(main())
