"""The quantize pipeline: walks a model block by block (capture, quantize one block, save)."""
