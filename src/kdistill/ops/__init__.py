"""Ops: the PyTorch reference math of every kernel (torch only; no kernel or dispatch imports)."""
