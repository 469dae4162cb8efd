"""Load a Hugging Face model folder (config.json + *.safetensors) into a ``Transformer``.

Safetensors files are memory-mapped and tensors are views into the map (copy-on-write), so loading a
bf16 checkpoint as bf16 on CPU copies nothing; other dtypes or devices convert tensor by tensor.
The pages of a mapped tensor stay resident once read; :func:`drop_pages` gives back those of tensors no
longer needed (the quantize pipeline, after each block).

A model loaded to run (``run=True``: generate, chat, eval) has the linears that read one input fused (q/k/v,
gate/up: ``qinfer.model.decoder.fuse_linears``) and its CPU weights copied out of the file maps into one anonymous map
of 2 MiB pages (Linux's transparent huge pages), see :func:`into_huge_pages`.
"""

import dataclasses
import errno
import json
import math
import mmap
import os
import struct
import weakref
from collections.abc import Iterable
from pathlib import Path

import torch

from qinfer.model.arch import ModelConfig
from qinfer.store.paths import cache_root
from qinfer.errors import QinferError
from qinfer.format import QUANT_CONFIG_FILE, QuantScheme, packed_weight
from qinfer.model.kv_cache import check_scale
from qinfer.model.decoder import BosState, QLinear, RMSNorm, Transformer, fuse_linears

BOS_HIDDEN = "model.bos_hidden"  # the stored BOS position's output; its keys and values: self_attn.bos_k / bos_v

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _redo(path: Path) -> str:
    """How to get a damaged weight file back: a built-in's is pulled again, a cached conversion made again."""
    root, folder = cache_root().absolute(), Path(path).absolute().parent
    if folder.parent == root / "models":
        return f"`qinfer pull {folder.name} --force` converts it again"
    if folder.parent == root / "converted":
        return f"delete {folder} and qinfer converts it again when next given the same model"
    if folder.parent == root / "quantized":
        return "`qinfer demo` quantizes its damaged copy again"
    if (folder / QUANT_CONFIG_FILE).is_file():
        return "quantize the model again"
    return "re-download or re-convert it"


def safetensors_header(path: Path) -> tuple[dict, int]:
    """(the checked JSON header of one .safetensors file without ``__metadata__``, the header's length): every
    tensor has a known dtype, a shape and data offsets that match it and lie inside the file."""
    path = Path(path)
    size = path.stat().st_size
    fix = _redo(path)
    corrupt = QinferError(f"{path} has a corrupt safetensors header: {fix}")
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise QinferError(f"{path} is truncated (no safetensors header): {fix}")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise QinferError(f"{path} is truncated or not a safetensors file: {fix}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise corrupt from None
    if not isinstance(header, dict):
        raise corrupt
    header.pop("__metadata__", None)
    for info in header.values():
        try:
            shape, (start, end) = info["shape"], info["data_offsets"]
            numel = math.prod(shape) if all(type(d) is int and d >= 0 for d in shape) else -1
            if type(start) is not int or type(end) is not int or not 0 <= start <= end or numel < 0:
                raise corrupt
            if end - start != numel * _DTYPES[info["dtype"]].itemsize:
                raise corrupt
        except (KeyError, TypeError, ValueError):
            if isinstance(info, dict) and isinstance(info.get("dtype"), str) and info["dtype"] not in _DTYPES:
                raise QinferError(f"{path}: a tensor has unsupported dtype {info['dtype']}") from None
            raise corrupt from None
    ends = [info["data_offsets"][1] for info in header.values()]
    if ends and 8 + n + max(ends) > size:
        raise QinferError(
            f"{path} is truncated ({size} bytes, header declares {8 + n + max(ends)}): {fix}"
        )
    return header, n


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Memory-map one .safetensors file; checks the header and that the file holds every byte it declares."""
    path = Path(path)
    header, n = safetensors_header(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
    if size:
        _MAPPINGS.append((weakref.ref(buf), torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr(), size))
    tensors = {}
    for name, info in header.items():
        dtype = _DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        count = (end - start) // dtype.itemsize
        t = torch.frombuffer(buf, dtype=dtype, count=count, offset=8 + n + start) if count else torch.empty(0, dtype=dtype)
        tensors[name] = t.view(info["shape"])
    return tensors


_MAPPINGS: list[tuple[weakref.ref, int, int]] = []  # (the map, its address, its size) per file read


def drop_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Let the OS reclaim the resident pages of memory-mapped checkpoint tensors that are done with: the
    whole pages inside each tensor's bytes are dropped from this process (``MADV_DONTNEED``). The maps are
    private and never written, so a later read of those bytes faults the file's contents back in: nothing
    is lost. Tensors not in a live map (copies, other devices) are skipped. Returns the bytes dropped."""
    _MAPPINGS[:] = [m for m in _MAPPINGS if m[0]() is not None]  # forget the maps already closed
    page, dropped = mmap.PAGESIZE, 0
    for t in tensors:
        if t.device.type != "cpu" or not t.numel():
            continue
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        for ref, base, size in _MAPPINGS:
            buf = ref()
            if buf is not None and base <= start and end <= base + size:
                a, b = -(-(start - base) // page) * page, (end - base) // page * page
                if b > a:
                    buf.madvise(mmap.MADV_DONTNEED, a, b - a)
                    dropped += b - a
                break
    return dropped


INDEX_FILE = "model.safetensors.index.json"


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files that hold ``folder``'s model, as transformers picks them: ``model.safetensors``,
    else the shards its ``model.safetensors.index.json`` lists, else every ``*.safetensors`` there. Other files
    beside a ``model.safetensors`` or an index (Mistral's ``consolidated.safetensors``, an adapter, a stale
    shard or index) are not read."""
    folder = Path(folder)
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise QinferError(f"{index} is not a safetensors index (a JSON object with a weight_map): "
                              "re-download it or remove it") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise QinferError(f"{folder}: {missing[0]} (listed in {INDEX_FILE}) is missing: re-download it")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise QinferError(f"{folder} has no *.safetensors weights: qinfer reads safetensors checkpoints only")
    for f in files:  # a dangling link (a Hugging Face cache snapshot whose blob is gone) or a folder
        if not f.is_file():
            what = "a link to a missing file" if f.is_symlink() and not f.exists() else "not a file"
            raise QinferError(f"{f} is {what}: re-download the model's weights")
    return files


def read_folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in weight_files(folder):
        tensors.update(read_safetensors(f))
    return tensors


def _base_prefixed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` under the names ``*ForCausalLM`` models use: a checkpoint saved from the base model (keys
    ``layers.0...``, ``embed_tokens.weight``) gains the ``model.`` prefix, one saved wrapped once more
    (``model.model.layers...``) loses one, as transformers adds or strips its ``base_model_prefix``."""
    base = [n for n in tensors if not n.startswith("lm_head.")]
    if base and not any(n.startswith("model.") for n in base) and any(
            n.startswith(("layers.", "embed_tokens.")) for n in base):
        return {n if n.startswith("lm_head.") else f"model.{n}": t for n, t in tensors.items()}
    if base and all(n.startswith("model.model.") for n in base):
        return {n.removeprefix("model."): t for n, t in tensors.items()}
    return tensors


def _distinct_head(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether ``tensors`` hold an lm_head of their own beside the embedding, which ``tie_word_embeddings``
    would otherwise overwrite: a fine-tune that trained the head and kept the base model's config. transformers
    (5.x) keeps such a head as stored, and so does qinfer."""
    head, embed = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    return head is not None and embed is not None and not torch.equal(head, embed)


def load_model(
    folder: Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu", run: bool = False
) -> Transformer:
    """Build the decoder for ``folder``'s config and fill it with the folder's weights. ``run``: laid out to run,
    not for the quantize pipeline to walk block by block: the linears that read one input fused
    (``qinfer.model.decoder.fuse_linears``), then :func:`into_huge_pages`."""
    folder = Path(folder)
    config = ModelConfig.from_folder(folder)
    tensors = _base_prefixed(read_folder_tensors(folder))
    with torch.device("meta"):
        model = Transformer(config)
    packed = _take_packed(folder, model, tensors, device)
    bos = _take_bos(folder, model, tensors, device, dtype)
    # A tied embedding under a quantized lm_head may be stored only as that lm_head (see qinfer.format).
    embed_from_head = (
        config.tie_word_embeddings and "lm_head.weight" in packed and "model.embed_tokens.weight" not in tensors
    )
    skip = set(packed) | ({"model.embed_tokens.weight"} if embed_from_head else set())
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in skip}
    expected = set(shapes)
    tied = "lm_head.weight" not in packed and config.tie_word_embeddings and not _distinct_head(tensors)
    if tied:  # one table, whichever name it is stored under (transformers ties from either)
        table = tensors.get("model.embed_tokens.weight", tensors.get("lm_head.weight"))
        if table is not None:
            tensors["model.embed_tokens.weight"] = tensors["lm_head.weight"] = table
    tensors = {name: t for name, t in tensors.items() if not name.endswith("rotary_emb.inv_freq")}
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    scheme = QuantScheme.load(folder) if missing and (folder / QUANT_CONFIG_FILE).exists() else None
    if scheme is not None and scheme.format == "int":  # integer linears are stored packed: name that
        head = scheme.quantize_lm_head
        linears = {f"{p}.weight" for p, m in model.named_modules() if isinstance(m, QLinear) and (head or p != "lm_head")}
        missing = [f"{n.removesuffix('.weight')}.qweight (packed)" if n in linears else n for n in missing]
    foreign = [n for n in unexpected if n.endswith((".qzeros", ".weight_packed", ".weight_scale"))]
    if foreign and not (folder / QUANT_CONFIG_FILE).exists():  # GPTQ's or compressed-tensors' tensor names
        raise QinferError(f"{folder} holds GPTQ or compressed-tensors weights ({foreign[0]}) but its config.json has "
                          "no quantization_config, which says how to read them: copy the checkpoint's config.json "
                          "again")
    packed_names = [n for n in unexpected if n.endswith((".qweight", ".scale"))]
    if packed_names and not (folder / QUANT_CONFIG_FILE).exists():
        raise QinferError(f"{folder} holds quantized weights ({packed_names[0]}) but no {QUANT_CONFIG_FILE}, which "
                          "says how to read them: copy it back from the folder `qinfer quantize` wrote")
    if missing or unexpected:
        what = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(unexpected[:3])}"
        raise QinferError(f"{folder}: weights do not match a {config.model_type} model with this config.json ({what})")
    norms = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, RMSNorm)}
    state = {}
    for name, t in tensors.items():
        if tuple(t.shape) != shapes[name]:
            raise QinferError(f"{folder}: {name} has shape {tuple(t.shape)}, config.json implies {shapes[name]}")
        if not t.is_floating_point():  # every unquantized tensor of the model holds real numbers
            raise QinferError(f"{folder}: {name} holds {str(t.dtype).removeprefix('torch.')} values, not floating "
                              "point ones: the checkpoint is damaged; download or convert it again")
        want = norms[name].weight_dtype(dtype, t.dtype) if name in norms else dtype
        state[name] = t.to(device=device, dtype=want)
    model.load_state_dict(state, assign=True, strict=False)
    for name, weight in packed.items():
        module: QLinear = model.get_submodule(name.removesuffix(".weight"))
        del module._parameters["weight"]
        module.weight = weight
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    if embed_from_head:
        model.model.embed_tokens.tie_to_packed(packed["lm_head.weight"], dtype)
    model.set_bos(bos)
    if run:
        held = list(_cpu_tensors(model).values())
        fuse_linears(model)
        drop_pages(held)  # the stacking read the fused linears' weights: their numbers live in the stacks now
        into_huge_pages(model)
    return model.eval()


HUGE_PAGE = 2 << 20
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_reason() -> str:
    """Why :func:`into_huge_pages` would leave a model where it is ('' when it would move it)."""
    if os.environ.get("QINFER_HUGE_PAGES", "1") == "0":
        return "QINFER_HUGE_PAGES=0"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "this OS has no transparent huge pages"
    try:
        setting = _THP_SETTING.read_text()
    except OSError:
        return f"{_THP_SETTING} is not readable"
    if "[never]" in setting:
        return "transparent huge pages are off ([never])"
    return ""


def weight_pages() -> str:
    """The pages a CPU model loaded with ``run=True`` holds its weights in, in a few words."""
    reason = huge_pages_reason()
    return f"4 KiB pages ({reason})" if reason else "2 MiB pages"


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` uint8 of fresh memory from a 2 MiB boundary on, advised ``MADV_HUGEPAGE`` (call only where
    :func:`huge_pages_reason` is ''). Private and anonymous: a shared map would be shmem, whose huge pages are
    another setting. The tensor, and every view of it, keeps the map alive."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    region.madvise(mmap.MADV_HUGEPAGE, start, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    return whole[start : start + nbytes]


COPY_SLICE = 16 << 20  # bytes copied between drops: the peak is one copy of the model and a slice, not two copies


def _cpu_tensors(model: Transformer) -> dict[int, torch.Tensor]:
    """The model's contiguous CPU tensors (parameters, buffers, packed weights' fields), by id."""
    tensors: dict[int, torch.Tensor] = {}
    for module in model.modules():
        found = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        packed = getattr(module, "weight", None)
        if dataclasses.is_dataclass(packed):
            found += [getattr(packed, f.name) for f in dataclasses.fields(packed)]
        for t in found:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous() and t.numel():
                tensors[id(t)] = t
    return tensors


def into_huge_pages(model: Transformer) -> int:
    """Copy the model's contiguous CPU tensors (parameters, buffers, packed weights) into one anonymous map
    advised ``MADV_HUGEPAGE`` and point each tensor at its copy (``set_``: every holder of the tensor, a tied
    lm_head or a packed weight's dataclass, sees the move). Returns the bytes moved: 0, and nothing changes,
    where :func:`huge_pages_reason` names a reason.

    A decode step reads every weight once from memory, small linears included. With 4 KiB pages a 2.6 MB
    weight spans 640 pages, and every page costs its own address translation (a page walk, nested under a
    virtual machine) that no prefetcher covers; 2 MiB pages need 2. ``python -m qinfer.evals.diagnostics.gemv_bench
    MODEL`` times a decode step in both; the figures are in docs/results.md, "Speed against the roofline".
    """
    if huge_pages_reason():
        return 0
    tensors = _cpu_tensors(model)
    # Tensors that share a storage (a fused weight and its members' views of it) move together: the bytes they
    # span are copied once and each is pointed at its place in the copy.
    spans: dict[int, list] = {}  # storage address -> [first byte, end byte, tensors]
    for t in tensors.values():
        start = t.storage_offset() * t.element_size()
        end = start + t.numel() * t.element_size()
        span = spans.setdefault(t.untyped_storage().data_ptr(), [start, end, []])
        span[0], span[1] = min(span[0], start), max(span[1], end)
        span[2].append(t)
    sizes = [-(-(end - start) // 64) * 64 for start, end, _ in spans.values()]
    total = sum(sizes)
    if not total:
        return 0
    try:
        whole, offset = huge_page_buffer(total), 0
    except OSError as e:  # no room for a second copy under an address-space limit (ulimit -v, strict overcommit)
        if e.errno != errno.ENOMEM:
            raise
        return 0  # the weights stay where they are, in 4 KiB pages
    base = whole.storage_offset()
    with torch.no_grad():
        for (start, end, found), size in zip(spans.values(), sizes):
            stored = torch.empty(0, dtype=torch.uint8).set_(found[0].untyped_storage())
            for a in range(start, end, COPY_SLICE):  # a file-mapped span's pages leave as it is copied
                b = min(a + COPY_SLICE, end)
                whole[offset + a - start : offset + b - start].copy_(stored[a:b])
                drop_pages([stored[a:b]])
            drop_pages(found)  # (and the pages that straddle two slices)
            for t in found:
                at = base + offset + t.storage_offset() * t.element_size() - start  # bytes into the map
                t.set_(whole.untyped_storage(), at // t.element_size(), t.shape, t.stride())
            offset += size
    return total


def is_bos_tensor(name: str) -> bool:
    """Whether ``name`` is one of a stored BOS position's tensors (qinfer.format)."""
    return name == BOS_HIDDEN or name.endswith(("self_attn.bos_k", "self_attn.bos_v"))


def bos_tensors(bos: BosState) -> dict[str, torch.Tensor]:
    """The stored form of a BOS position (qinfer.format, "The BOS position")."""
    tensors = {BOS_HIDDEN: bos.hidden}
    for i, (k, v) in enumerate(bos.kv):
        tensors[f"model.layers.{i}.self_attn.bos_k"], tensors[f"model.layers.{i}.self_attn.bos_v"] = k, v
    return tensors


def _take_bos(folder: Path, model: Transformer, tensors: dict, device: str, dtype: torch.dtype) -> BosState | None:
    """Pop a stored BOS position (qinfer.format) from ``tensors``, or None if the folder has none."""
    names = [(f"model.layers.{i}.self_attn.bos_k", f"model.layers.{i}.self_attn.bos_v") for i in range(len(model.model.layers))]
    found = [n for n in (BOS_HIDDEN, *(n for pair in names for n in pair)) if n in tensors]
    if not found:
        return None
    c = model.config
    shapes = {BOS_HIDDEN: (c.hidden_size,), **{n: (c.num_kv_heads, c.head_dim) for pair in names for n in pair}}
    if len(found) != len(shapes) or c.bos_token_id is None or any(tuple(tensors[n].shape) != shapes[n] for n in found):
        raise QinferError(f"{folder}: a stored BOS position needs a bos_token_id in config.json, a [{c.hidden_size}] "
                          f"{BOS_HIDDEN} and a [{c.num_kv_heads}, {c.head_dim}] bos_k and bos_v in every layer's "
                          "self_attn: quantize the model again")
    take = lambda name: tensors.pop(name).to(device=device, dtype=dtype)  # noqa: E731
    return BosState(kv=[(take(k), take(v)) for k, v in names], hidden=take(BOS_HIDDEN))


def _take_packed(folder: Path, model: Transformer, tensors: dict, device: str) -> dict:
    """Pop the packed linears of a qinfer-quantized folder out of ``tensors``: {"<prefix>.weight": packed}.

    Also pops the KV-cache scales into ``model.kv_scales`` ({layer: (k_scale, v_scale)}).
    """
    model.kv_scales = {}
    if not (folder / QUANT_CONFIG_FILE).exists():
        return {}
    scheme = QuantScheme.load(folder)
    packed = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, QLinear):
            continue
        w = packed_weight(prefix, tensors, scheme.lm_head_scheme() if prefix == "lm_head" else scheme)
        if w is None:
            continue
        if tuple(w.shape) != (module.out_features, module.in_features):
            raise QinferError(f"{folder}: {prefix} is packed as {tuple(w.shape)}, config.json implies "
                              f"{(module.out_features, module.in_features)}")
        for key in w.tensors(prefix):
            tensors.pop(key)
        packed[f"{prefix}.weight"] = w.to(device)
    n_kv, head_dim = model.config.num_kv_heads, model.config.head_dim
    again = "quantize the original model again with --kv-cache"
    for i in range(model.config.num_layers):
        k, v = (tensors.pop(f"model.layers.{i}.self_attn.{n}_scale", None) for n in "kv")
        if k is None and v is None:
            continue
        if k is None or v is None:
            have, lack = ("k", "v") if v is None else ("v", "k")
            raise QinferError(f"{folder}: layer {i} has a {have}_scale but no {lack}_scale: the checkpoint is "
                              f"incomplete; {again}")
        if scheme.kv_cache == "none":
            raise QinferError(f"{folder}: layer {i} has KV-cache scales but {QUANT_CONFIG_FILE} says kv_cache none, so "
                              "which cache dtype they scale is unknown: quantize the original model again with "
                              "--kv-cache int8|fp8")
        for n, t in (("k", k), ("v", v)):
            if tuple(t.shape) not in {(n_kv,), (n_kv, head_dim)}:  # per KV head and channel, or per head
                raise QinferError(f"{folder}: model.layers.{i}.self_attn.{n}_scale has shape {tuple(t.shape)}, not "
                                  f"one per KV head and channel ({n_kv}, {head_dim}) or per KV head ({n_kv},): {again}")
            check_scale(folder, f"model.layers.{i}.self_attn.{n}_scale", t, again)
        model.kv_scales[i] = (k.float().to(device), v.float().to(device))
    missing = [i for i in range(model.config.num_layers) if i not in model.kv_scales]
    if model.kv_scales and missing:
        which = f"layers {', '.join(map(str, missing))} have" if len(missing) > 1 else f"layer {missing[0]} has"
        raise QinferError(f"{folder}: {which} no KV-cache scales but the others do: the checkpoint is incomplete; "
                          f"{again}")
    return packed
