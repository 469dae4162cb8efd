"""Kernels: dequant-matmul and attention, each with a pure-torch reference."""
