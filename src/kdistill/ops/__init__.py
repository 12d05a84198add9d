"""Ops: each file holds the PyTorch reference math, the kernel key and the dispatch to its kernel."""
