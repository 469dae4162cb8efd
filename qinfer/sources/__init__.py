"""Sources: the built-in registry and pull, resolving a MODEL argument, GGUF conversion, tokenizers."""
