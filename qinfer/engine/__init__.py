"""Generation and chat on the model."""
