"""Evaluation: perplexity, KL, multiple-choice tasks, speed and roofline."""
