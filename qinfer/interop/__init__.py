"""Converters between qinfer's packed format and other published checkpoint layouts.

Pure tensor-dict functions at the edge, each module's docstring stating its layout bit for bit:
:mod:`qinfer.interop.gptq` (GPTQ format v1: ``qweight``/``qzeros``/``scales``/``g_idx``) and
:mod:`qinfer.interop.compressed_tensors` (``pack-quantized`` integers and ``float-quantized`` FP8);
:mod:`qinfer.interop.folders` applies them to whole checkpoint folders (``qinfer export``, and foreign
folders given as MODEL).
"""
