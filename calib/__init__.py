"""Calibration data (corpora, sampling) and block-by-block activation capture."""
