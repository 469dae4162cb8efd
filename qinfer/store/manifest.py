"""A manifest of the files qinfer wrote into a cache folder, and what no longer matches it."""

import json
from pathlib import Path

from qinfer.store.atomic import write_atomic


MANIFEST = ".manifest.json"  # in a folder qinfer made in the cache: {file name: bytes} of everything it wrote


def write_manifest(folder: Path) -> None:
    """Record the name and size of every file in ``folder`` (a conversion qinfer made in the cache)."""
    folder = Path(folder)
    sizes = {f.name: f.stat().st_size for f in sorted(folder.iterdir()) if f.is_file() and f.name != MANIFEST}
    write_atomic(folder / MANIFEST, json.dumps(sizes, indent=1))


def damage(folder: Path) -> str:
    """What no longer matches ``folder``'s manifest (a file missing or of another size), or '' if all does. A
    folder without a manifest (made by an older qinfer) is taken as it is if it has the weights every
    conversion writes."""
    folder = Path(folder)
    try:
        sizes = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        if not folder.is_dir():
            return f"{folder} is missing"
        return "" if (folder / "model.safetensors").is_file() else "model.safetensors is missing"
    except (OSError, ValueError):
        return f"its {MANIFEST} is unreadable"
    if not isinstance(sizes, dict):
        return f"its {MANIFEST} is unreadable"
    for name, size in sizes.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, not the {size} written"
    return ""
