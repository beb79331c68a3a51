"""Attention kernels as a per-model choice: the kernels (``kernels``), Video Sparse Attention (``vsa``), fake-quantized
attention for quantization-aware training (``qat``), and how a choice is installed on a family's self-attention
(``install``)."""
