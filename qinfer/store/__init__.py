"""Shared ground: the cache's paths, atomic writes, locks, manifests and fingerprints."""
