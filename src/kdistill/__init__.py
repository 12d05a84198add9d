"""kdistill: logit knowledge distillation of causal language models.

Distils a teacher LM into a smaller student without ever materialising [tokens x vocab] logits,
with Triton kernels on NVIDIA GPUs that are compiled before training and a PyTorch reference path
that runs everywhere.
"""

__version__ = "0.1.0"
