"""The paged KV cache, optionally quantized: per layer a pool of fixed-size blocks, per sequence a block table.

Memory is a number of blocks of ``block_size`` positions shared by every sequence, block ``b`` the same in every
layer (the layout, bit for bit, is in ``qinfer.format``, "The paged KV cache"). A sequence holds the blocks its
:class:`BlockTable` lists; a block may have several holders (:class:`BlockPool` counts them), so that sequences
with a common prefix can share its full blocks. Running out of blocks is :class:`OutOfBlocks`, which a caller
can act on (a scheduler preempts a sequence and retries); nothing is ever half-allocated.

The model attends through :meth:`KVCache.attend`: the new keys and values go into their sequences' pages
(quantized on the way in, for "int8" and "fp8"), and the queries attend over the cached positions from
``start`` (the first key any of them may see: past a sliding window, the keys before it are never read) to the
newest, as stored, with the layer's scales when quantized: a decode step reads the pages in place
(``qinfer.kernels.attention.paged_decode``), a prompt's chunk over the positions gathered into a slice.

A quantized cache has two scales: one per layer, KV head and channel (``c``, fixed) and one per position and KV
head (``t``, set as each is written, from its own range)::

    t = max_d |x_d / c_d| / QMAX                          (QMAX: 127 for int8, 448 for fp8)
    int8: q = round(x / (c t))                            x ≈ q * c * t
    fp8:  q = fp8_e4m3(x / (c t))

The channel scales come from calibration (``scales``: {layer: (k_scale, v_scale)}, each [Hkv, D] as ``qinfer
quantize --kv-cache`` stores them, or [Hkv], one per head, as a compressed-tensors import has them), else are 1:
only their ratios matter here (``t`` takes each position's magnitude), so they keep a few wide channels from
taking the steps of the narrow ones, and scales calibrated for either dtype serve both. Nothing clips, however
far a key lies past what calibration (or the prompt) showed, and a position's codes depend on it alone, not on
the batch or the prompt it came with. The position scales cost 4 bytes per position and KV head each for keys
and values. How much a scale per position and calibrated channel scales lower an int8 cache's KL is measured in
docs/results.md ("Choosing a quantize setting" and "Figures formerly in code comments").
"""

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from qinfer.errors import QinferError
from qinfer.kernels.attention import attention, dequantize_kv, paged_decode
from qinfer.kernels.paged_attention import gather_pages, write_pages
from qinfer.model.arch import ModelConfig

KV_DTYPES = {"bf16": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX = {"int8": 127.0, "fp8": 448.0}
BLOCK_SIZES = (8, 16, 32, 64, 128)  # what the attention kernels take: a power of two, 8 to 128 positions
BLOCK_SIZE = 16


def check_scale(where, name: str, scale: torch.Tensor, fix: str) -> None:
    """Refuse a stored KV-cache scale that is not finite and positive: NaN or infinity reads every cached key
    back as NaN, and 0 as 0, without a word."""
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if bool(bad.any()):
        raise QinferError(f"{where}: {name} holds {float(scale[bad][0]):g}, not a finite positive scale: {fix}")


class OutOfBlocks(QinferError):
    """Not enough free blocks for a request: free some (finish or preempt a sequence) and retry."""


class BlockPool:
    """Which blocks are free, how many holders each allocated block has, and which hold a known prefix.

    A full block can be registered under a key naming its tokens and every token before it (:meth:`register`:
    the prefix cache). When no one holds it any more it stays findable (:meth:`lookup`), free but cached, and
    :meth:`share` takes it back, until an allocation needs it: free blocks that hold nothing known go first, then
    cached ones, least recently released first (each then forgets its key).
    """

    def __init__(self, num_blocks: int):
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # holding nothing known; popped from the end: low ids first
        self._cached: OrderedDict[int, None] = OrderedDict()  # free, but registered: least recently released first
        self._key_of: dict[int, tuple] = {}
        self._block_of: dict[tuple, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    def allocate(self, n: int) -> list[int]:
        """``n`` free blocks, each now held once; all or none (:class:`OutOfBlocks`)."""
        if n > self.num_free:
            raise OutOfBlocks(f"{n} KV-cache blocks wanted, {self.num_free} free of {len(self.refs)}: raise "
                              "--kv-memory, or run fewer or shorter sequences at once")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:  # evict the least recently released cached block
                b = self._cached.popitem(last=False)[0]
                del self._block_of[self._key_of.pop(b)]
            self.refs[b] = 1
            blocks.append(b)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more holder of each of ``blocks`` (a sequence reusing a prefix's blocks); a cached free block is
        taken back."""
        for b in blocks:
            if self.refs[b] < 1:
                if b not in self._cached:
                    raise ValueError(f"block {b} is free: only an allocated or cached block can be shared")
                del self._cached[b]
            self.refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        """One holder fewer of each of ``blocks``; a block no one holds is free again (cached, if registered)."""
        for b in blocks:
            if self.refs[b] < 1:
                raise ValueError(f"block {b} is already free")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self._key_of:
                    self._cached[b] = None
                else:
                    self._free.append(b)

    def register(self, block: int, key: tuple) -> None:
        """Name held ``block`` by ``key`` (its tokens and their prefix's), unless another block already has that
        key or this one has a key."""
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key], self._key_of[block] = block, key

    def lookup(self, key: tuple) -> int | None:
        """The block registered under ``key``, held or cached, else None."""
        return self._block_of.get(key)

    @property
    def cached_blocks(self) -> int:
        """Blocks registered under a key (held or free)."""
        return len(self._key_of)


def block_key(parent: tuple | None, tokens: tuple[int, ...]) -> tuple:
    """The prefix-cache key of a full block of ``tokens`` after the block keyed ``parent`` (None: the first).
    A key holds its parent's hash, not the parent itself, so it costs the same at any depth."""
    return (None if parent is None else hash(parent), tokens)


@dataclass
class BlockTable:
    """One sequence's blocks, in position order."""

    blocks: list[int] = field(default_factory=list)


class KVCache:
    """Every layer's pages, the pool of block ids, the scales of a quantized cache, and the sequences the next
    forward runs (``tables``: one per batch row, each holding the blocks for its positions)."""

    def __init__(
        self,
        config: ModelConfig,
        batch: int,
        max_len: int,
        dtype: torch.dtype,
        device="cpu",
        kv_dtype: str = "bf16",
        scales: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        block_size: int = BLOCK_SIZE,
        num_blocks: int | None = None,
    ):
        """Pages for ``num_blocks`` blocks (default: what ``batch`` sequences of ``max_len`` positions fill), and
        ``batch`` sequences, each given the blocks for ``max_len`` positions (two at least)."""
        if kv_dtype not in KV_DTYPES:
            raise QinferError(f"unknown KV-cache dtype {kv_dtype!r}: use one of {', '.join(KV_DTYPES)}")
        if block_size not in BLOCK_SIZES:
            raise QinferError(f"KV-cache block size {block_size} is not supported: use one of "
                              f"{', '.join(map(str, BLOCK_SIZES))} ({BLOCK_SIZE} is the default)")
        # at least two blocks each: torch.compile specializes a dimension of size 1, so the pages and block table
        # of a one-block sequence would compile a graph of their own
        per_sequence = max(2, -(-max_len // block_size))
        num_blocks = batch * per_sequence if num_blocks is None else num_blocks
        if num_blocks < 1:
            raise QinferError("the KV cache needs at least one block: raise --kv-memory")
        Hkv, D = config.num_kv_heads, config.head_dim
        self.config, self.block_size, self.dtype, self.kv_dtype = config, block_size, dtype, kv_dtype
        self.pool = BlockPool(num_blocks)
        store = KV_DTYPES[kv_dtype] or dtype
        shape = (num_blocks, Hkv, block_size, D)  # [N, Hkv, P, D]
        # (separate tensors, not views of one: a deep copy of views, as eval --compile makes, does not compile)
        self.k = [torch.zeros(shape, dtype=store, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=store, device=device) for _ in range(config.num_layers)]
        # quantized: per layer the channel scales (k_scale, v_scale), each [Hkv, D] fp32 (1 where not calibrated),
        # and the position scales of keys and of values, [N, Hkv, P] fp32 each
        self.scales, self.k_pos, self.v_pos = {}, [], []
        if kv_dtype != "bf16":
            ones = torch.ones(Hkv, D, device=device)
            self.scales = {i: tuple(_per_channel(x, Hkv, D, device) for x in scales[i]) if scales and i in scales
                           else (ones, ones) for i in range(config.num_layers)}
            self.k_pos = [torch.ones(shape[:3], device=device) for _ in range(config.num_layers)]
            self.v_pos = [torch.ones(shape[:3], device=device) for _ in range(config.num_layers)]
        self.tables: list[BlockTable] = []
        self.block_tables = torch.zeros(0, per_sequence, dtype=torch.long, device=device)
        self.bind([self.new_sequence(per_sequence * block_size) for _ in range(batch)])

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int = BLOCK_SIZE, kv_dtype: str = "bf16",
                        dtype: torch.dtype = torch.bfloat16) -> int:
        """What one block costs across all layers: keys and values, and their position scales when quantized."""
        per_position = config.num_kv_heads * config.head_dim * (KV_DTYPES[kv_dtype] or dtype).itemsize
        if kv_dtype != "bf16":
            per_position += config.num_kv_heads * 4  # one fp32 position scale per KV head
        return 2 * per_position * block_size * config.num_layers

    @classmethod
    def blocks_for_memory(cls, config: ModelConfig, budget: int, block_size: int = BLOCK_SIZE, kv_dtype: str = "bf16",
                          dtype: torch.dtype = torch.bfloat16) -> int:
        """How many blocks ``budget`` bytes hold (one at least, or a one-line refusal)."""
        per_block = cls.bytes_per_block(config, block_size, kv_dtype, dtype)
        if budget < per_block:
            raise QinferError(f"--kv-memory {budget} bytes is less than one KV-cache block of {block_size} positions "
                              f"({per_block} bytes for this model): raise --kv-memory")
        return budget // per_block

    def bytes_per_token(self) -> int:
        """Bytes one cached position of every bound sequence occupies across all layers (keys and values, with
        their position scales)."""
        per_block = self.bytes_per_block(self.config, self.block_size, self.kv_dtype, self.dtype)
        return per_block // self.block_size * len(self.tables)

    @property
    def num_blocks(self) -> int:
        return len(self.pool.refs)

    def new_sequence(self, length: int) -> BlockTable:
        """A sequence holding the blocks for ``length`` positions (:class:`OutOfBlocks` if they are not free)."""
        table = BlockTable()
        self.reserve(table, length)
        return table

    def reserve(self, table: BlockTable, length: int) -> None:
        """Give ``table`` the blocks it needs to hold ``length`` positions (all or none: :class:`OutOfBlocks`)."""
        need = -(-length // self.block_size) - len(table.blocks)
        if need > 0:
            table.blocks += self.pool.allocate(need)

    def free(self, table: BlockTable) -> None:
        """Return a sequence's blocks (a block someone else holds stays allocated) and empty its table."""
        self.pool.release(table.blocks)
        table.blocks = []

    def bind(self, tables: list[BlockTable]) -> None:
        """Run the next forwards over these sequences, one per batch row."""
        width = max([len(t.blocks) for t in tables] + [1])
        rows = [t.blocks + [0] * (width - len(t.blocks)) for t in tables]  # (padding: never read)
        self.tables = list(tables)
        self.block_rows = rows  # block_tables as lists (a decode step's slots, read without a tensor op)
        self.block_tables = torch.tensor(rows, dtype=torch.long, device=self.k[0].device)

    def slots(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block [B, T], row [B, T]) of ``positions`` [T] in each bound sequence."""
        return self.block_tables[:, positions // self.block_size], positions % self.block_size

    def store(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int = 0,
              end: int | None = None):
        # input_pos: [T]; k, v: [B, Hkv, T, D] -> (k, v, scales): cached positions start:end, [B, Hkv, end - start,
        # D], as stored, and for a quantized cache (k_scale, v_scale, k_pos, v_pos): channel scales [Hkv, D] and
        # position scales [B, Hkv, end - start] (None for a bf16 cache); end is input_pos[-1] + 1 (given by a
        # caller that has it as an int)
        end = int(input_pos[-1]) + 1 if end is None else end
        if end > self.block_tables.shape[1] * self.block_size:
            raise ValueError(f"the KV cache holds {self.block_tables.shape[1] * self.block_size} positions per "
                             f"sequence; position {end - 1} does not fit")
        self.write(layer, input_pos, k, v)
        return self.read(layer, start, end)

    def write(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [B, Hkv, T, D] at ``input_pos`` [T] of every bound sequence, quantized where the pages hold
        codes."""
        block, row = self.slots(input_pos)  # [B, T], [T]
        slots = (block * self.block_size + row).reshape(-1)  # [B * T], sequence by sequence
        k, v = (x.transpose(1, 2).reshape(-1, *x.shape[1:2], x.shape[3]) for x in (k, v))  # [B * T, Hkv, D]
        self.write_slots(layer, slots, k, v)

    def write_slots(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] at ``slots`` [T] (``block * block_size + row``), quantized where the pages hold
        codes."""
        k_scale, v_scale = self.scales.get(layer, (None, None))
        write_pages(self.k[layer], self.v[layer], slots, k, v, k_scale, v_scale, *self.position_scales(layer))

    def layer_scales(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        """A quantized cache's scales of ``layer`` as the attention kernels take them (k_scale, v_scale, k_pos,
        v_pos), else None."""
        return (*self.scales[layer], self.k_pos[layer], self.v_pos[layer]) if self.scales else None

    def position_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A quantized cache's position scales of keys and values in ``layer`` ([N, Hkv, P] each), else None."""
        return (self.k_pos[layer], self.v_pos[layer]) if self.k_pos else (None, None)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, input_pos: torch.Tensor,
               start: int, end: int, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Write k, v [B, Hkv, T, D] at ``input_pos`` [T] and attend q [B, H, T, D] over positions start..end-1
        (``mask`` [T, end]: True where a query may see a key; unused for one query, which sees them all)."""
        self.write(layer, input_pos, k, v)
        if q.shape[2] == 1:  # a decode step: read in place where a kernel can
            return paged_decode(q, self.k[layer], self.v[layer], self.block_tables, start, end, scale,
                                self.layer_scales(layer))
        k, v, scales = self.read(layer, start, end)
        return attention(q, k, v, mask[:, start:], scale, scales)

    def read(self, layer: int, start: int, end: int):
        """Positions start..end-1 of every bound sequence as stored: (k, v [B, Hkv, end - start, D], scales), the
        scales as :meth:`store` returns them."""
        positions = torch.arange(start, end, device=self.block_tables.device)
        k, v = (gather_pages(pages, self.block_tables, positions) for pages in (self.k[layer], self.v[layer]))
        if self.kv_dtype == "bf16":
            return k, v, None
        k_pos, v_pos = (gather_pages(pos, self.block_tables, positions)
                        for pos in (self.k_pos[layer], self.v_pos[layer]))
        return k, v, (*self.scales[layer], k_pos, v_pos)

    def update(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int = 0,
               end: int | None = None):
        """As :meth:`store`, the cached positions in the compute dtype: (k, v)."""
        k, v, scales = self.store(layer, input_pos, k, v, start, end)
        if scales is None:
            return k, v
        k_scale, v_scale, k_pos, v_pos = scales
        return dequantize_kv(k, k_scale, self.dtype, k_pos), dequantize_kv(v, v_scale, self.dtype, v_pos)


class DecodeRows:
    """Rows that each run one token of a sequence at a position of its own, in one forward: the decode steps of
    many sequences, and the generated tokens of a preempted one being computed again (several rows of one
    sequence). Passed to the model in place of the cache (``Transformer.decode_rows``): :meth:`attend` writes
    every row's key and value, then attends each row's query over its sequence's positions up to its own (from
    the first its layer's sliding window shows), the same sums whatever the other rows are."""

    def __init__(self, cache: KVCache, tables: list[BlockTable], positions: list[int]):
        width = max(len(t.blocks) for t in tables)
        device = cache.k[0].device
        self.cache = cache
        self.block_tables = torch.tensor([t.blocks + [0] * (width - len(t.blocks)) for t in tables],
                                         dtype=torch.long, device=device)  # [M, width] (padding: never read)
        self.positions = torch.tensor(positions, dtype=torch.long, device=device)  # [M]
        P = cache.block_size
        rows = torch.arange(len(tables), device=device)
        self.slots = self.block_tables[rows, self.positions // P] * P + self.positions % P  # [M]
        self.ends = self.positions + 1
        self._starts: dict[int | None, torch.Tensor] = {}

    def starts(self, window: int | None) -> torch.Tensor:
        """[M]: each row's first visible position under ``window`` (None: 0)."""
        if window not in self._starts:
            first = torch.zeros_like(self.positions) if window is None else (self.positions - window + 1).clamp_min(0)
            self._starts[window] = first
        return self._starts[window]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, input_pos, start, end, mask,
               scale: float) -> torch.Tensor:
        """q [M, H, 1, D], k, v [M, Hkv, 1, D] -> [M, H, 1, D]; ``input_pos``, ``start``, ``end`` and ``mask``
        are unused: each row's range comes from its own position."""
        c = self.cache
        c.write_slots(layer, self.slots, k[:, :, 0], v[:, :, 0])
        starts = self.starts(c.config.sliding_window[layer])
        return paged_decode(q, c.k[layer], c.v[layer], self.block_tables, starts, self.ends, scale,
                            c.layer_scales(layer))


def _per_channel(scale: torch.Tensor, Hkv: int, D: int, device) -> torch.Tensor:
    # [Hkv] (one per head) or [Hkv, D] -> [Hkv, D] fp32
    if scale.numel() not in (Hkv, Hkv * D):
        raise QinferError(f"a KV-cache scale has {scale.numel()} values; this model needs {Hkv} (one per KV head) or "
                          f"{Hkv * D} (per head and channel): quantize the model again with --kv-cache")
    return scale.float().to(device).reshape(Hkv, -1).expand(Hkv, D).contiguous()


def make_cache(model, batch: int, max_len: int, kv_dtype: str = "bf16", block_size: int = BLOCK_SIZE,
               num_blocks: int | None = None) -> KVCache:
    """A cache for ``batch`` sequences of up to ``max_len`` positions of ``model`` (a ``Transformer``), of
    ``kv_dtype``, with the channel scales ``qinfer quantize --kv-cache`` stored in its folder, if any; ``num_blocks``
    as :class:`KVCache` takes it (an engine's: ``batch`` 0)."""
    if kv_dtype not in KV_DTYPES:
        raise QinferError(f"unknown KV-cache dtype {kv_dtype!r}; use one of {', '.join(KV_DTYPES)}")
    scales = (getattr(model, "kv_scales", None) or None) if kv_dtype != "bf16" else None
    return KVCache(model.config, batch, max_len, model.dtype, model.device, kv_dtype=kv_dtype, scales=scales,
                   block_size=block_size, num_blocks=num_blocks)
