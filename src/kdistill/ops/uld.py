"""Universal logit distillation (ULD): a KD loss between distributions over different vocabularies.

For an aligned pair of positions (student position i, teacher position j; see kdistill.data.align)::

    q = sort_desc(softmax(s_i / T))   padded with zeros to V = max(Vs, Vt)
    p = sort_desc(softmax(t_j / T))   padded likewise
    ULD_i = sum_k |p_k - q_k|

Sorting makes the two vocabularies comparable without a token mapping: the loss matches the shapes of
the distributions (the Wasserstein-1 distance between them under a cost that is 0 between equal ranks
and 1 otherwise, as in Boizard et al., "Towards cross-tokenizer distillation: the universal logit
distillation loss"). No T^2 factor: the distance is bounded by 2 at every temperature. The gradient
flows through the sort (to the student's probabilities at their ranks). PyTorch only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def uld_rows(s_logits: torch.Tensor, t_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """ULD_i per row: s_logits (c, Vs), t_logits (c, Vt) -> (c,) in at least fp32."""
    dt = torch.promote_types(s_logits.dtype, torch.float32)
    q = torch.softmax(s_logits.to(dt) / temperature, dim=-1).sort(dim=-1, descending=True).values
    with torch.no_grad():
        p = torch.softmax(t_logits.to(dt) / temperature, dim=-1).sort(dim=-1, descending=True).values
    v = max(q.shape[1], p.shape[1])
    q = F.pad(q, (0, v - q.shape[1]))
    p = F.pad(p, (0, v - p.shape[1]))
    return (p - q).abs().sum(-1)
