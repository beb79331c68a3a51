"""fvx: functional training of video diffusion transformers on PyTorch."""

__version__ = "0.2.0"
