"""The decode step as a graph of tile tasks joined by monotonic counters.

Every task computes one tile of one op of one layer, reads and writes flat element ranges (`Region`s) of named buffers,
waits for counters to reach thresholds before it starts, and adds 1 to exactly one counter when it is done. A counter's
threshold is the number of tasks that signal it (within one launch; a persistent kernel that never resets its counters
compares with epoch x producers). Per layer l, with x[0] the input hidden and x[l + 1] the layer's output:

    QKV      rows [lo, hi) of Wqkv (rms(x[l]) w_attn) + bqkv -> qkv[l] waits down[l-1] (every down tile of layer l-1)
    ATTN     group g, KV split s: rope(q heads of g), rope(k_g), v_g, waits qkv[l].g (the tiles of group g's rows)
             then the online-softmax partial (o, m, l) over split s
             of the cached positions 0..position-1 (split 0 also takes
             the new token, from registers) -> att[l]; split 0 writes
             the KV cache row at `position`
    COMBINE  group g: the splits' partials of its heads combined,    waits attn[l].g (group g's splits)
             a = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s
             -> ao[l]
    OPROJ    rows [lo, hi): x[l] + Wo ao[l] -> h[l]                 waits combine[l] (every group)
    GATEUP   rows [lo, hi): silu(Wg m) * (Wu m), m = rms(h[l]) w_mlp waits oproj[l]
             -> act[l]
    DOWN     rows [lo, hi): h[l] + Wd act -> x[l + 1]               waits gateup[l]

rms(v) = v / sqrt(mean(v^2) + eps). The norms and the rotary embedding are recomputed by each consumer tile (hidden
and (G + 2) x head_dim elements, read from L2) instead of being tasks of their own: every task boundary is a
release -> acquire hop on the critical path (6 a layer here instead of 9), while the recomputation is a few KB per
tile. The attention splits are combined once a group (COMBINE), a hop, rather than by every O projection tile, which
re-read S x Hq x (D + 2) partials each (39% of the SMs' busy time of a Llama-3.2-1B step when it did: the H200 trace
in benchmarks/results/h200/notes.md). Design limits: batch 1; every intermediate buffer is written once per launch
(per-layer scratch, so only read-after-write edges exist); Wqkv is packed group-major, [q heads of group g, k_g, v_g]
for g = 0 .. Hk-1 (its biases bqkv alike, zeros without qkv_bias), so that a group's rows are a contiguous run of
QKV tiles, which signal one counter (qkv[l], every tile, where a tile spans two groups); the KV splits are static
and split s covers positions [s c, (s + 1) c) of 0..position-1, c = ceil(position / splits) (a split past the end is
empty)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

from .config import DecoderConfig


class Kind(IntEnum):
    QKV = 0
    ATTN = 1  # tile (g, g + 1), split s
    OPROJ = 2
    GATEUP = 3
    DOWN = 4
    COMBINE = 5  # tile (g, g + 1)


class Region(NamedTuple):
    buffer: str
    lo: int
    hi: int


@dataclass(frozen=True)
class Task:
    id: int
    kind: Kind
    layer: int
    lo: int
    hi: int
    split: int
    reads: tuple[Region, ...]
    writes: tuple[Region, ...]
    waits: tuple[tuple[int, int], ...]  # (counter, threshold)
    signal: int
    bytes: int  # estimated bytes moved (weights, activations, KV cache at the context hint)

    @property
    def label(self) -> str:
        extra = f"/{self.split}" if self.kind == Kind.ATTN else ""
        return f"{self.kind.name.lower()}[{self.layer}]({self.lo}:{self.hi}{extra})#{self.id}"


@dataclass(frozen=True)
class Tiling:
    """Output rows per task of each projection, and KV splits per group of the attention."""

    qkv: int = 64
    o: int = 64
    gateup: int = 64
    down: int = 64
    kv_splits: int = 4

    def __post_init__(self):
        for name in ("qkv", "o", "gateup", "down", "kv_splits"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Tiling: {name} must be an int >= 1, got {v!r}")

    @classmethod
    def auto(cls, config: DecoderConfig, num_sms: int, align: int = 16) -> Tiling:
        """About one tile of every projection per SM (rows rounded up to `align`, the MMA's granularity), and enough
        KV splits to give each SM about one attention task (at most 16)."""

        def rows(n: int) -> int:
            return -(-max(1, -(-n // num_sms)) // align) * align

        return cls(
            qkv=rows((config.num_heads + 2 * config.num_kv_heads) * config.head_dim),
            o=rows(config.hidden),
            gateup=rows(config.intermediate),
            down=rows(config.hidden),
            kv_splits=max(1, min(16, num_sms // config.num_kv_heads)),
        )


@dataclass
class TaskGraph:
    config: DecoderConfig
    tiling: Tiling
    tasks: list[Task] = field(default_factory=list)  # in a topological order
    counters: list[str] = field(default_factory=list)  # counter id -> label
    buffers: dict[str, int] = field(default_factory=dict)  # name -> elements
    inputs: frozenset[str] = frozenset()  # buffers nobody in the graph writes
    output: str = ""

    def producers(self) -> list[list[int]]:
        """Counter id -> ids of the tasks that signal it."""
        out: list[list[int]] = [[] for _ in self.counters]
        for t in self.tasks:
            out[t.signal].append(t.id)
        return out


def qkv_rows_of_group(config: DecoderConfig, g: int) -> tuple[int, int]:
    """Rows of the packed Wqkv (and elements of qkv[l]) that belong to KV group g: G q heads, then k_g, then v_g."""
    stride = (config.group + 2) * config.head_dim
    return g * stride, (g + 1) * stride


def build_graph(
    config: DecoderConfig, tiling: Tiling | None = None, context_hint: int | None = None, weight_bytes: int = 2
) -> TaskGraph:
    """The task graph of one decode step. `context_hint` (default max_seq) and `weight_bytes` only feed the byte
    estimates that balance the schedule."""
    c, t = config, tiling or Tiling()
    D, G, Hk, Hq = c.head_dim, c.group, c.num_kv_heads, c.num_heads
    S, ctx, ab = t.kv_splits, min(context_hint or c.max_seq, c.max_seq), 4  # activations are float32
    nqkv = (Hq + 2 * Hk) * D
    graph = TaskGraph(config=c, tiling=t)
    counter_ids: dict[str, int] = {}
    inputs = {"x[0]"}

    def counter(name: str) -> int:
        if name not in counter_ids:
            counter_ids[name] = len(graph.counters)
            graph.counters.append(name)
        return counter_ids[name]

    def buf(name: str, size: int, is_input: bool = False) -> str:
        graph.buffers[name] = size
        if is_input:
            inputs.add(name)
        return name

    def add(kind, layer, lo, hi, reads, writes, waits, signal, split=0, extra_bytes=0):
        def nbytes(regions):
            return sum((r.hi - r.lo) * (weight_bytes if r.buffer.startswith("w") else ab) for r in regions)

        graph.tasks.append(
            Task(
                id=len(graph.tasks),
                kind=kind,
                layer=layer,
                lo=lo,
                hi=hi,
                split=split,
                reads=tuple(reads),
                writes=tuple(writes),
                waits=tuple((counter(w), 0) for w in waits),
                signal=counter(signal),
                bytes=nbytes(reads) + nbytes(writes) + extra_bytes,
            )
        )

    def tiles(n, size):
        return [(lo, min(n, lo + size)) for lo in range(0, n, size)]

    buf("x[0]", c.hidden)
    for layer in range(c.num_layers):
        L = f"[{layer}]"
        x, h, x_next = f"x{L}", buf(f"h{L}", c.hidden), buf(f"x[{layer + 1}]", c.hidden)
        qkv = buf(f"qkv{L}", nqkv)
        kv_new = buf(f"kv_new{L}", 2 * Hk * D)  # the KV cache row at `position`: k heads, then v heads
        buf(f"kv_cache{L}", 2 * c.max_seq * Hk * D, is_input=True)  # rows before `position`, read by ATTN
        att = buf(f"att{L}", S * Hq * (D + 2))  # (split, head, [o (D), m, l])
        ao = buf(f"ao{L}", Hq * D)  # the attention output, head-major
        act = buf(f"act{L}", c.intermediate)
        w_an, w_mn = buf(f"w_attn_norm{L}", c.hidden, True), buf(f"w_mlp_norm{L}", c.hidden, True)
        wqkv, wo = buf(f"wqkv{L}", nqkv * c.hidden, True), buf(f"wo{L}", c.hidden * Hq * D, True)
        bqkv = buf(f"wqkv_bias{L}", nqkv, True)
        wg, wu = buf(f"wgate{L}", c.intermediate * c.hidden, True), buf(f"wup{L}", c.intermediate * c.hidden, True)
        wd = buf(f"wdown{L}", c.hidden * c.intermediate, True)

        # one counter a KV group, not a tile: an ATTN task waits once (a wait a tile cost an acquire load's L2 round
        # trip each: Llama-3.2-1B's 12 in a row took ~3.7 us on an H100)
        qkv_tiles = tiles(nqkv, t.qkv)
        stride = (G + 2) * D
        per_group = all(lo // stride == (hi - 1) // stride for lo, hi in qkv_tiles)
        qkv_counter = [f"qkv{L}.{g}" if per_group else f"qkv{L}" for g in range(Hk)]  # by KV group
        for lo, hi in qkv_tiles:
            reads = [Region(x, 0, c.hidden), Region(w_an, 0, c.hidden), Region(wqkv, lo * c.hidden, hi * c.hidden)]
            add(
                Kind.QKV,
                layer,
                lo,
                hi,
                [*reads, Region(bqkv, lo, hi)],
                [Region(qkv, lo, hi)],
                [f"down[{layer - 1}]"] if layer else [],
                qkv_counter[lo // stride],
            )
        chunk = -(-max(ctx - 1, 0) // S)
        for g in range(Hk):
            lo, hi = qkv_rows_of_group(c, g)
            need = [qkv_counter[g]]
            for s in range(S):
                row = (s * Hq + g * G) * (D + 2)
                new_row = [Region(kv_new, g * D, (g + 1) * D), Region(kv_new, (Hk + g) * D, (Hk + g + 1) * D)]
                add(
                    Kind.ATTN,
                    layer,
                    g,
                    g + 1,
                    [Region(qkv, lo, hi)],
                    [Region(att, row, row + G * (D + 2))] + (new_row if s == 0 else []),
                    need,
                    f"attn{L}.{g}",
                    split=s,
                    extra_bytes=2 * chunk * D * weight_bytes,
                )
        for g in range(Hk):
            parts = [Region(att, (s * Hq + g * G) * (D + 2), (s * Hq + g * G + G) * (D + 2)) for s in range(S)]
            add(Kind.COMBINE, layer, g, g + 1, parts, [Region(ao, g * G * D, (g + 1) * G * D)], [f"attn{L}.{g}"],
                f"combine{L}")  # fmt: skip
        for lo, hi in tiles(c.hidden, t.o):
            add(
                Kind.OPROJ,
                layer,
                lo,
                hi,
                [Region(ao, 0, Hq * D), Region(wo, lo * Hq * D, hi * Hq * D), Region(x, lo, hi)],
                [Region(h, lo, hi)],
                [f"combine{L}"],
                f"oproj{L}",
            )
        for lo, hi in tiles(c.intermediate, t.gateup):
            add(
                Kind.GATEUP,
                layer,
                lo,
                hi,
                [
                    Region(h, 0, c.hidden),
                    Region(w_mn, 0, c.hidden),
                    Region(wg, lo * c.hidden, hi * c.hidden),
                    Region(wu, lo * c.hidden, hi * c.hidden),
                ],
                [Region(act, lo, hi)],
                [f"oproj{L}"],
                f"gateup{L}",
            )
        for lo, hi in tiles(c.hidden, t.down):
            add(
                Kind.DOWN,
                layer,
                lo,
                hi,
                [
                    Region(act, 0, c.intermediate),
                    Region(wd, lo * c.intermediate, hi * c.intermediate),
                    Region(h, lo, hi),
                ],
                [Region(x_next, lo, hi)],
                [f"gateup{L}"],
                f"down{L}",
            )

    # thresholds: every wait needs all of the counter's producers
    count = [0] * len(graph.counters)
    for task in graph.tasks:
        count[task.signal] += 1
    graph.tasks = [
        Task(**{**task.__dict__, "waits": tuple((cid, count[cid]) for cid, _ in task.waits)}) for task in graph.tasks
    ]
    graph.inputs = frozenset(inputs)
    graph.output = f"x[{c.num_layers}]"
    return graph


def pack_weights(config: DecoderConfig, layers: list[dict]) -> dict:
    """Weight buffers in the graph's layouts (see the module docstring), flattened; torch tensors, same dtype."""
    import torch

    c, D, G = config, config.head_dim, config.group
    out = {}
    for i, w in enumerate(layers):
        q = w["q"].reshape(c.num_kv_heads, G * D, c.hidden)
        k = w["k"].reshape(c.num_kv_heads, D, c.hidden)
        v = w["v"].reshape(c.num_kv_heads, D, c.hidden)
        out[f"wqkv[{i}]"] = torch.cat([q, k, v], dim=1).reshape(-1).contiguous()
        zeros = w["q"].new_zeros  # a layer without biases: zeros, so that every step adds them alike
        bq = w.get("q_bias", zeros(c.q_size)).reshape(c.num_kv_heads, G * D)
        bk, bv = (w.get(n, zeros(c.kv_size)).reshape(c.num_kv_heads, D) for n in ("k_bias", "v_bias"))
        out[f"wqkv_bias[{i}]"] = torch.cat([bq, bk, bv], dim=1).reshape(-1).contiguous()
        for short, name in (
            ("attn_norm", "w_attn_norm"),
            ("mlp_norm", "w_mlp_norm"),
            ("o", "wo"),
            ("gate", "wgate"),
            ("up", "wup"),
            ("down", "wdown"),
        ):
            out[f"{name}[{i}]"] = w[short].reshape(-1).contiguous()
    return out
