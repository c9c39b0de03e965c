"""Context-parallel (ring) attention over ``mx.distributed``.

Each rank of a group holds one shard of the sequence of Q, K and V. The K/V
shards travel around the ring in pieces (rank r sends to r+1 and receives
from r-1, forwarding each piece as far as some rank needs it) while every
rank attends its queries to each piece as it arrives; the partial results
are merged exactly through the row log-sum-exp (``lse``), the same
online-softmax merge the fused kernels use across key tiles, into one
output buffer updated in place. :func:`decode_attention` merges the same way
the partials of new queries against a KV cache split across the ranks.

Layouts (how the global sequence is cut into shards):

- ``"zigzag"``: the sequence is cut into ``2n`` chunks and rank r holds
  chunks ``r`` and ``2n-1-r``, so under a causal mask every rank does the same
  work (see :func:`attention_work`);
- ``"contiguous"``: ``n`` chunks, rank r holds chunk ``r`` (the last rank does
  most of the causal work).

Failure behaviour: every communication step runs under a watchdog. A peer
that died is reported as :class:`DistributedError` by MLX's ring backend at
once; a peer that hangs or never connects would block forever, so after
``timeout`` seconds (default :data:`DEFAULT_TIMEOUT_S`, or the environment
variable :data:`TIMEOUT_ENV`) the process prints what it waited for and exits
with :data:`WATCHDOG_EXIT_CODE` (a blocked native call cannot be interrupted);
:func:`init` (whose native connection loop holds the GIL) is ended by SIGTERM
from a watcher process instead.
See ``docs/distributed.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
from typing import Literal

import mlx.core as mx

from mlx_attn.core.checks import check_bool, check_int, check_optional_int
from mlx_attn.ops import AttentionCall, attention_path, scaled_dot_product_attention

__all__ = [
    "DistributedError",
    "RingStats",
    "init",
    "ring_attention",
    "merge_partials",
    "decode_attention",
    "shard_sequence",
    "unshard_sequence",
    "chunk_ids",
    "attention_work",
    "LAYOUTS",
    "TIMEOUT_ENV",
    "DEFAULT_TIMEOUT_S",
    "WATCHDOG_EXIT_CODE",
]

Layout = Literal["zigzag", "contiguous"]
LAYOUTS = ("zigzag", "contiguous")
TIMEOUT_ENV = "MLX_ATTN_DISTRIBUTED_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
WATCHDOG_EXIT_CODE = 75  # EX_TEMPFAIL: a peer, not this rank, is at fault
# Queries per attention call when blocks take the reference path (no fused
# kernel): bounds the float32 score tile (rows x keys) a rank materializes.
_REFERENCE_QUERY_TILE = 256
# K/V travel in pieces of about 1/_PIECES_PER_CHUNK of a chunk (at least
# _MIN_PIECE positions): what bounds a rank's memory beyond its own shards.
_PIECES_PER_CHUNK = 8
_MIN_PIECE = 64
# The blocks' backend; tests set "reference" to cover the tiled path.
_BLOCK_BACKEND = "auto"


class DistributedError(RuntimeError):
    """A communication step failed (a peer died or disconnected)."""


@dataclasses.dataclass
class RingStats:
    """Counters a caller may pass to :func:`ring_attention` (accumulated)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    # visible query-key pairs in the blocks this rank computed (its attention work)
    visible_pairs: int = 0
    ring_steps: int = 0  # K/V shards attended to: its own, then one per other rank whose pieces arrived


# --------------------------------------------------------------------------
# watchdog and checked communication


def _timeout_seconds(timeout: float | None) -> float:
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_TIMEOUT_S
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"environment variable {TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
        what = f"environment variable {TIMEOUT_ENV}"
    else:
        what = "timeout"
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"{what} must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def _timeout_message(what: str, seconds: float) -> str:
    rank = os.environ.get("MLX_RANK", "?")
    return (
        f"mlx_attn.distributed: rank {rank}: {what} did not finish within {seconds:g} s "
        f"(a peer hung, died or never connected; set {TIMEOUT_ENV} to wait longer); exiting\n"
    )


@contextlib.contextmanager
def _watchdog(what: str, timeout: float | None):
    """Exits the process (code WATCHDOG_EXIT_CODE) with a clear message if the
    block runs past ``timeout``. A thread suffices because ``mx.eval``
    releases the GIL while it waits on a socket."""
    seconds = _timeout_seconds(timeout)

    def expire():
        sys.stderr.write(_timeout_message(what, seconds))
        sys.stderr.flush()
        os._exit(WATCHDOG_EXIT_CODE)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


# The watcher process waits on its stdin: EOF (we finished or died) ends it quietly.
_WATCHER = """\
import os, select, signal, sys
seconds, message, parent = float(sys.argv[1]), sys.argv[2], int(sys.argv[3])
if not select.select([sys.stdin], [], [], seconds)[0]:
    sys.stderr.write(message)
    sys.stderr.flush()
    os.kill(parent, signal.SIGTERM)
"""


@contextlib.contextmanager
def _process_watchdog(what: str, timeout: float | None):
    """Like :func:`_watchdog` for native calls that keep the GIL (MLX's
    connection loop in ``mx.distributed.init``), where no Python thread can
    run: a watcher process prints the message and ends this one with SIGTERM."""
    seconds = _timeout_seconds(timeout)
    watcher = subprocess.Popen(
        [sys.executable, "-c", _WATCHER, str(seconds), _timeout_message(what, seconds), str(os.getpid())],
        stdin=subprocess.PIPE,
    )
    try:
        yield
    finally:
        watcher.stdin.close()
        watcher.wait()


def communicate(what: str, arrays, group, timeout):
    """Evaluates communication ``arrays`` under the watchdog; errors become DistributedError."""
    with _watchdog(f"{what} (rank {group.rank()} of {group.size()})", timeout):
        try:
            mx.eval(*arrays)
        except RuntimeError as error:
            raise DistributedError(
                f"rank {group.rank()} of {group.size()}: {what} failed: {error} "
                f"(a peer died or disconnected)"
            ) from error


def init(*, backend: str = "ring", timeout: float | None = None) -> mx.distributed.Group:
    """``mx.distributed.init(strict=True, backend=backend)`` under the watchdog:
    a peer that never connects ends this process after ``timeout`` seconds
    instead of hanging (MLX's ring backend waits forever): the process is
    ended with SIGTERM after a message on stderr."""
    if backend == "ring":
        _check_hostfile()
    with _process_watchdog(f"connecting the {backend!r} group", timeout):
        return mx.distributed.init(strict=True, backend=backend)


HOSTFILE_ENV = "MLX_HOSTFILE"  # what mlx.launch --backend ring sets for each rank


def _check_hostfile() -> None:
    """The ring backend's hostfile, read before MLX does: a JSON list with one
    entry per rank, each a non-empty list of "host:port" strings. A missing
    or malformed file is a ValueError naming the variable and the file (MLX
    reports a bare parse error, or crashes on an empty list)."""
    path = os.environ.get(HOSTFILE_ENV)
    if path is None:
        return
    where = f"{HOSTFILE_ENV}={path!r}"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if not text.strip():
            return  # what mlx.launch writes for a ring of one host: MLX's own case
        hosts = json.loads(text)
    except OSError as error:
        raise ValueError(f"{where}: cannot read the hostfile ({error.strerror or error})") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{where}: the hostfile is not JSON ({error})") from None
    form = 'a JSON list with one entry per rank, each a list of "host:port" strings'
    if not isinstance(hosts, list) or not hosts:
        raise ValueError(f"{where}: the hostfile must be {form}, got {type(hosts).__name__} {hosts!r:.80}")
    for rank, entry in enumerate(hosts):
        if (not isinstance(entry, list) or not entry
                or not all(isinstance(h, str) and h.rpartition(":")[2].isdigit() for h in entry)):
            raise ValueError(f"{where}: entry {rank} of the hostfile must be a non-empty list of \"host:port\" "
                             f"strings ({form}), got {entry!r:.80}")
    rank = os.environ.get("MLX_RANK")
    if rank is not None and rank.strip().isdigit() and int(rank) >= len(hosts):
        raise ValueError(f"{where}: MLX_RANK={rank} but the hostfile lists {len(hosts)} ranks")


def _group(group) -> mx.distributed.Group:
    if group is None:
        return mx.distributed.init()
    if not isinstance(group, mx.distributed.Group):
        raise ValueError(f"group must be an mx.distributed.Group or None, got {type(group).__name__}")
    return group


# --------------------------------------------------------------------------
# layouts


def _check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _chunk_count(layout: Layout, ranks: int) -> int:
    return 2 * ranks if layout == "zigzag" else ranks


def chunk_ids(layout: Layout, rank: int, ranks: int) -> tuple[int, ...]:
    """The global chunk indices rank ``rank`` of ``ranks`` holds, in shard order."""
    _check_layout(layout)
    if layout == "zigzag":
        return (rank, 2 * ranks - 1 - rank)
    return (rank,)


def _check_axis(x: mx.array, axis: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis must be an integer in [{-x.ndim}, {x.ndim}) for shape {tuple(x.shape)}, got {axis!r}")
    return axis % x.ndim


def shard_sequence(x: mx.array, *, group=None, layout: Layout = "zigzag", axis: int = 2) -> mx.array:
    """This rank's shard of the full sequence ``x`` (cut along ``axis``)."""
    group = _group(group)
    _check_layout(layout)
    if not isinstance(x, mx.array):
        raise ValueError(f"x must be an mlx array, got {type(x).__name__}")
    axis = _check_axis(x, axis)
    chunks = _chunk_count(layout, group.size())
    length = x.shape[axis]
    if length % chunks:
        raise ValueError(
            f"sequence length {length} (axis {axis}) must be divisible by {chunks} "
            f"for layout {layout!r} on {group.size()} ranks"
        )
    pieces = mx.split(x, chunks, axis=axis)
    return mx.concatenate([pieces[i] for i in chunk_ids(layout, group.rank(), group.size())], axis=axis)


def unshard_sequence(
    x_shard: mx.array, *, group=None, layout: Layout = "zigzag", axis: int = 2, timeout: float | None = None
) -> mx.array:
    """The full sequence from every rank's shard (an ``all_gather``); the inverse of
    :func:`shard_sequence`. Every rank gets the whole array."""
    group = _group(group)
    _check_layout(layout)
    if not isinstance(x_shard, mx.array):
        raise ValueError(f"x_shard must be an mlx array, got {type(x_shard).__name__}")
    axis = _check_axis(x_shard, axis)
    ranks = group.size()
    per_rank = len(chunk_ids(layout, 0, ranks))
    if x_shard.shape[axis] % per_rank:
        raise ValueError(
            f"shard length {x_shard.shape[axis]} (axis {axis}) must be divisible by {per_rank} for layout {layout!r}"
        )
    check_same_across_ranks("x_shard", _shape_signature(x_shard), group, timeout)
    if ranks == 1:
        return x_shard
    front = mx.moveaxis(x_shard, axis, 0)
    gathered = mx.distributed.all_gather(front, group=group)
    communicate("unshard_sequence all_gather", [gathered], group, timeout)
    chunk = x_shard.shape[axis] // per_rank
    by_chunk = gathered.reshape(ranks * per_rank, chunk, *front.shape[1:])
    owner_slot = {c: r * per_rank + i for r in range(ranks) for i, c in enumerate(chunk_ids(layout, r, ranks))}
    ordered = by_chunk[mx.array([owner_slot[c] for c in range(ranks * per_rank)])]
    return mx.moveaxis(ordered.reshape(-1, *front.shape[1:]), 0, axis)


# --------------------------------------------------------------------------
# cross-rank validation

_DTYPE_CODES = {mx.float32: 1, mx.float16: 2, mx.bfloat16: 3}


def _shape_signature(*arrays: mx.array) -> list[int]:
    sig = []
    for a in arrays:
        sig += [a.ndim, *a.shape, _DTYPE_CODES.get(a.dtype, 0)]
    return sig


def check_same_across_ranks(what: str, signature: list[int], group, timeout) -> None:
    """All ranks must pass the same ``signature`` (shapes, dtypes, options):
    one small all_gather, so a mismatch is an error on every rank, not a hang.
    ``timeout`` is checked on a group of one too (no collective runs there)."""
    _timeout_seconds(timeout)
    if group.size() == 1:
        return
    mine = mx.array(signature, dtype=mx.int64)
    everyone = mx.distributed.all_gather(mine[None], group=group)
    communicate(f"checking {what} across ranks", [everyone], group, timeout)
    rows = everyone.tolist()
    differing = [r for r, row in enumerate(rows) if row != rows[group.rank()]]
    if differing:
        raise ValueError(
            f"{what} differ across ranks: rank {group.rank()} has {rows[group.rank()]}, "
            f"rank {differing[0]} has {rows[differing[0]]} (shapes, dtypes and options must agree)"
        )


# --------------------------------------------------------------------------
# visibility of a key block to a query block


def _block_kind(q_start: int, q_len: int, k_start: int, k_len: int, causal: bool, window_size: int | None) -> str:
    """How queries at global positions ``[q_start, q_start+q_len)`` see keys at
    ``[k_start, k_start+k_len)``: ``"skip"`` (no pair visible), ``"full"``,
    ``"diagonal"`` (the same positions: lower-right aligned causal with the
    window) or ``"partial"`` (needs a boolean mask)."""
    if not causal:
        return "full"
    q_last, k_last = q_start + q_len - 1, k_start + k_len - 1
    if k_start > q_last:
        return "skip"  # every key is in every query's future
    if window_size is not None and k_last <= q_start - window_size:
        return "skip"  # every key is older than every query's window
    all_past = k_last <= q_start
    all_in_window = window_size is None or k_start > q_last - window_size
    if all_past and all_in_window:
        return "full"
    if q_start == k_start and q_len == k_len:
        return "diagonal"
    return "partial"


def _block_mask(kind: str, q_start: int, q_len: int, k_start: int, k_len: int, window_size: int | None):
    """The ``mask`` argument for :func:`_attend_block` of a non-skipped block."""
    if kind == "full":
        return None
    if kind == "diagonal":
        return "causal"
    positions = mx.arange(q_start, q_start + q_len)[:, None]
    keys = mx.arange(k_start, k_start + k_len)[None, :]
    visible = keys <= positions
    if window_size is not None:
        visible = visible & (keys > positions - window_size)
    return visible


def _visible_pairs(q_start, q_len, k_start, k_len, causal, window_size) -> int:
    """Query-key pairs that are visible (the attention work), without building masks."""
    total = 0
    for p in range(q_start, q_start + q_len):
        hi = min(p, k_start + k_len - 1) if causal else k_start + k_len - 1
        lo = max(k_start, p - window_size + 1) if (causal and window_size is not None) else k_start
        total += max(0, hi - lo + 1)
    return total


def attention_work(
    seq_len: int, ranks: int, *, layout: Layout = "zigzag", causal: bool = True, window_size: int | None = None
) -> list[int]:
    """Visible query-key pairs per rank (proportional to its attention FLOPs)
    for a ``seq_len`` sequence split by ``layout``."""
    seq_len = check_int("seq_len", seq_len, minimum=1)
    ranks = check_int("ranks", ranks, minimum=1)
    window_size = check_optional_int("window_size", window_size, minimum=1)
    causal = check_bool("causal", causal)
    _check_layout(layout)
    chunks = _chunk_count(layout, ranks)
    if seq_len % chunks:
        raise ValueError(f"seq_len {seq_len} must be divisible by {chunks} for layout {layout!r} on {ranks} ranks")
    c = seq_len // chunks
    return [
        sum(_visible_pairs(qi * c, c, 0, seq_len, causal, window_size) for qi in chunk_ids(layout, r, ranks))
        for r in range(ranks)
    ]


# --------------------------------------------------------------------------
# block attention and the merge


def _scores_materialized(q, k, v) -> bool:
    return attention_path(q, k, v, scale=1.0, backend=_BLOCK_BACKEND) == "reference"


def _attend_block(q, k, v, *, scale, mask=None, window_size=None):
    """Attention of ``q`` to one key block: ``(out, lse)``. ``out`` is
    normalized within the block; ``lse`` ``[B, Hq, Tq]`` float32 is the
    natural-log row log-sum-exp of the scaled scores (``-inf``, with
    ``out = 0``, for a row that sees no key). ``mask`` is None, "causal"
    (with ``window_size``) or a bool array ``[Tq, Tk]``."""
    return scaled_dot_product_attention(
        q, k, v, scale=scale, mask=mask, window_size=window_size if isinstance(mask, str) else None,
        backend=_BLOCK_BACKEND, return_lse=True,
    )


@mx.compile  # one fused elementwise pass: no float32 temporaries per term
def _merge(out_a, lse_a, out_b, lse_b):
    lse_a, lse_b = lse_a.astype(mx.float32), lse_b.astype(mx.float32)
    top = mx.maximum(lse_a, lse_b)
    top = mx.where(top == -mx.inf, 0.0, top)
    weight_a, weight_b = mx.exp(lse_a - top), mx.exp(lse_b - top)
    total = weight_a + weight_b
    lse = top + mx.log(total)
    safe_total = mx.where(total == 0, 1.0, total)[..., None]
    out = (out_a.astype(mx.float32) * weight_a[..., None] + out_b.astype(mx.float32) * weight_b[..., None]) / safe_total
    return out, lse


def merge_partials(out_a: mx.array, lse_a: mx.array, out_b: mx.array, lse_b: mx.array):
    """Exact softmax merge of two partial attentions over disjoint key sets.

    ``out_*`` ``[..., T, Dv]`` are each normalized over their own keys and
    ``lse_*`` ``[..., T]`` are their row log-sum-exps; returns ``(out, lse)``
    in float32 as if attention had run over the union. A side with
    ``lse = -inf`` (no key seen) contributes nothing; both ``-inf`` give
    ``out = 0, lse = -inf`` (never NaN).
    """
    return _merge(out_a, lse_a, out_b, lse_b)


def _merge_gathered(gathered: mx.array, ranks: int, value_dim: int):
    """Folds the ``ranks`` partials of an all_gather (rank order, so every
    rank merges the same numbers the same way and gets identical bits)."""
    parts = mx.split(gathered, ranks, axis=0)
    out, lse = parts[0][..., :value_dim], parts[0][..., value_dim]
    for part in parts[1:]:
        out, lse = merge_partials(out, lse, part[..., :value_dim], part[..., value_dim])
    return out, lse


def decode_attention(
    q: mx.array,
    k: mx.array | None,
    v: mx.array | None,
    *,
    scale: float,
    group: mx.distributed.Group | None = None,
    backend: str = "auto",
    timeout: float | None = None,
) -> mx.array:
    """Attention of a few new queries to keys spread over the ranks.

    Every rank passes the same ``q`` ``[B, Hq, Tq, D]`` and its own part of
    the keys and values ``k`` ``[B, Hkv, S_r, D]``, ``v`` ``[B, Hkv, S_r, Dv]``
    (any split, any order; ``None`` or ``S_r = 0`` for a rank that holds
    none); no mask: every query sees every key. Each rank computes its
    partial ``(out, lse)`` with ``return_lse=True``, one ``all_gather``
    brings all of them to every rank, and they merge exactly by log-sum-exp
    in rank order. Returns ``[B, Hq, Tq, Dv]`` in ``q``'s dtype, identical on
    every rank, equal to ``scaled_dot_product_attention`` over all the keys.
    """
    group = _group(group)
    if (k is None) != (v is None):
        raise ValueError("k and v must both be arrays or both be None")
    if not isinstance(q, mx.array) or q.ndim != 4:
        raise ValueError(f"q must be a 4-d mlx array [B, Hq, Tq, D], got {getattr(q, 'shape', type(q).__name__)}")
    # Every rank validates its own call before any collective, a rank holding
    # no keys too (on stand-ins of no length): a bad argument is an error on
    # every rank, never one rank missing from the all_gather the others wait in.
    if k is None:
        k = v = mx.zeros((q.shape[0], q.shape[1], 0, q.shape[3]), q.dtype)
    call = AttentionCall.build(q, k, v, scale=scale, backend=backend, return_lse=True)
    value_dim = v.shape[-1]
    check_same_across_ranks("decode_attention queries (q, value width)", _shape_signature(q) + [value_dim],
                            group, timeout)
    return decode_attention_unchecked(q, k, v, scale=scale, group=group, backend=backend, timeout=timeout,
                                      call=call)


def decode_attention_unchecked(q, k, v, *, scale, group, backend, timeout, call: AttentionCall | None = None):
    """:func:`decode_attention` without the cross-rank check (generation
    checks its inputs once, not at every layer of every token); ``call``:
    the rank's validated call, when the caller built it."""
    if k is not None and k.shape[2] > 0:
        if call is None:
            call = AttentionCall.build(q, k, v, scale=scale, backend=backend, return_lse=True)
        out, lse = call.run()
        value_dim = v.shape[-1]
    else:  # nothing held here: a partial that contributes nothing
        value_dim = v.shape[-1] if v is not None else q.shape[-1]
        out = mx.zeros((*q.shape[:3], value_dim), mx.float32)
        lse = mx.full(q.shape[:3], -mx.inf)
    if group.size() == 1:
        return out.astype(q.dtype)
    packed = mx.concatenate([out.astype(mx.float32), lse.astype(mx.float32)[..., None]], axis=-1)
    gathered = mx.distributed.all_gather(packed, group=group)
    communicate("decode_attention all_gather", [gathered], group, timeout)
    merged, _ = _merge_gathered(gathered, group.size(), value_dim)
    return merged.astype(q.dtype)


# --------------------------------------------------------------------------
# ring attention


@dataclasses.dataclass
class _Shard:
    """The global chunk positions of one rank's shard."""

    chunks: tuple[int, ...]
    chunk_len: int

    def spans(self):
        """(chunk id, global start, offset in the shard) for each chunk."""
        return [(c, c * self.chunk_len, i * self.chunk_len) for i, c in enumerate(self.chunks)]

    def pieces(self, piece_len: int):
        """(global start, length, offset in the shard) of each piece of at
        most ``piece_len`` positions, chunk by chunk, in shard order."""
        return [
            (start + p, min(piece_len, self.chunk_len - p), offset + p)
            for _, start, offset in self.spans()
            for p in range(0, self.chunk_len, piece_len)
        ]


def _piece_len(chunk_len: int) -> int:
    """Positions per travelling K/V piece (and per query tile on the fused
    path): a fraction of a chunk, so a rank never holds a whole received
    block, but not so small that messages and kernel calls dominate."""
    return min(chunk_len, max(_MIN_PIECE, -(-chunk_len // _PIECES_PER_CHUNK)))


@dataclasses.dataclass(frozen=True)
class _Piece:
    source: int  # the rank whose shard it is
    start: int  # global position of its first key
    length: int
    offset: int  # where it starts in the source's shard
    reach: int  # how many ranks along the ring it travels (the farthest that needs it)


def _ring_schedule(ranks: int, layout_of, kv_len: int, q_len: int, causal: bool, window_size):
    """The rounds of the exchange, identical on every rank: ``rounds[t][r]``
    is the piece rank r sends to r+1 in round t (or None). A rank forwards
    the piece it received the round before while it still has to travel,
    else sends its next own piece; so it holds at most the piece it
    forwards and the one it receives, never a whole block."""

    def needs(rank: int, piece_start: int, piece_len: int) -> bool:
        q_shard = layout_of(rank, q_len)
        return any(_block_kind(start, q_shard.chunk_len, piece_start, piece_len, causal, window_size) != "skip"
                   for _, start, _ in q_shard.spans())

    own = []
    for source in range(ranks):
        shard = layout_of(source, kv_len)
        pieces = []
        for start, length, offset in shard.pieces(_piece_len(shard.chunk_len)):
            reach = max((d for d in range(1, ranks) if needs((source + d) % ranks, start, length)), default=0)
            if reach:
                pieces.append(_Piece(source, start, length, offset, reach))
        own.append(pieces)
    carried = [None] * ranks  # (piece, hops travelled) each rank received last round
    rounds = []
    while True:
        sends = []
        for r in range(ranks):
            held = carried[r]
            if held is not None and held[1] < held[0].reach:
                sends.append((held[0], held[1] + 1))
            elif own[r]:
                sends.append((own[r].pop(0), 1))
            else:
                sends.append(None)
        if all(s is None for s in sends):
            return rounds
        rounds.append([s[0] if s else None for s in sends])
        carried = [sends[(r - 1) % ranks] for r in range(ranks)]


def _check_ring_arguments(q, k, v, *, scale, mask, group, sinks, window_size, layout, timeout,
                          stats) -> tuple[bool, int]:
    """:func:`ring_attention`'s checks, the local ones first, then one
    comparison across the ranks: ``(causal, query chunks per rank)``."""
    _check_layout(layout)
    if isinstance(mask, mx.array):
        raise ValueError(
            "ring_attention takes mask=None or mask='causal'; array masks are not supported "
            "(they would have to be sharded with the sequence)"
        )
    # Local checks (shapes, dtypes, scale, sinks, window) are those of the single-process API.
    attention_path(q, k, v, scale=scale, mask=mask, sinks=sinks, window_size=window_size)
    if stats is not None and not isinstance(stats, RingStats):
        raise ValueError(f"stats must be a RingStats or None, got {type(stats).__name__}")
    causal = mask == "causal" or window_size is not None
    ranks = group.size()
    per_rank = len(chunk_ids(layout, 0, ranks)) if causal else 1
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(
            f"causal ring attention needs query and key shards of the same length (one sequence), "
            f"got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if q.shape[2] % per_rank:
        raise ValueError(
            f"shard length {q.shape[2]} must be divisible by {per_rank} for layout {layout!r} "
            f"(the global length by {_chunk_count(layout, ranks)})"
        )
    options = [LAYOUTS.index(layout), int(causal), window_size or 0, int(sinks is not None)]
    check_same_across_ranks(
        "ring_attention inputs (q, k, v, [layout, causal, window, sinks])",
        _shape_signature(q, k, v) + options,
        group,
        timeout,
    )
    return causal, per_rank


def ring_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: str | None = None,
    group: mx.distributed.Group | None = None,
    sinks: mx.array | None = None,
    window_size: int | None = None,
    layout: Layout = "zigzag",
    timeout: float | None = None,
    stats: RingStats | None = None,
) -> mx.array:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Every rank passes its shard (see :func:`shard_sequence`) of ``q``
    ``[B, Hq, T/n, D]``, ``k`` ``[B, Hkv, T/n, D]`` and ``v`` ``[B, Hkv, T/n, Dv]``
    and gets back its shard of the output ``[B, Hq, T/n, Dv]``, equal to
    ``scaled_dot_product_attention`` on the full sequence.

    ``mask`` is ``None`` or ``"causal"`` over the full sequence (array masks
    are rejected: they would have to be sharded too); ``window_size`` implies
    causal and key blocks wholly outside every window are never sent nor
    computed. ``sinks`` ``[Hq]`` join the softmax once. K/V travel at
    ``Hkv`` heads (GQA is never expanded). Merging is in float32; the output
    has the inputs' promoted dtype. Without a causal mask the query and key
    shards may differ in length (and the layout does not matter).

    ``timeout``: seconds any communication step may block (see the module
    docstring); ``stats``: a :class:`RingStats` to accumulate counters into.

    Raises:
        ValueError: bad arguments, or shapes/options that differ across ranks.
        DistributedError: a peer died during the exchange.
    """
    group = _group(group)
    causal, per_rank = _check_ring_arguments(q, k, v, scale=scale, mask=mask, group=group, sinks=sinks,
                                             window_size=window_size, layout=layout, timeout=timeout, stats=stats)
    ranks, rank = group.size(), group.rank()

    out_dtype = mx.result_type(q.dtype, k.dtype, v.dtype)
    q_len, kv_len = q.shape[2], k.shape[2]
    if causal:
        layout_of = lambda r, length: _Shard(chunk_ids(layout, r, ranks), length // per_rank)
    else:  # positions do not matter: one block per rank
        layout_of = lambda r, length: _Shard((r,), length)
    q_shard = layout_of(rank, q_len)

    tile_len = _REFERENCE_QUERY_TILE if _scores_materialized(q, k, v) else _piece_len(q_shard.chunk_len)
    output = _TiledOutput(q, q_shard.pieces(tile_len), v.shape[-1], sinks, scale=scale, causal=causal,
                          window_size=window_size, stats=stats)
    attend = output.attend
    k_shard = layout_of(rank, kv_len)
    for start, length, offset in k_shard.pieces(_piece_len(k_shard.chunk_len)):
        attend(k[:, :, offset : offset + length], v[:, :, offset : offset + length], start)
    if stats is not None:
        stats.ring_steps += 1
    _exchange(_ring_schedule(ranks, layout_of, kv_len, q_len, causal, window_size), group, k, v, attend,
              timeout, stats)
    return output.out if out_dtype == mx.float32 else output.out.astype(out_dtype)


class _TiledOutput:
    """A rank's output of :func:`ring_attention`, accumulated in place in one
    float32 buffer (merged tile by tile, so no second output-sized array
    ever exists); each query tile ``(start, length, offset)`` keeps its row
    log-sum-exp. Sinks start the accumulator: a partial with no value and
    log-mass `sink`."""

    def __init__(self, q, tiles, value_dim: int, sinks, *, scale, causal, window_size, stats):
        b, hq, q_len = q.shape[:3]
        self.q, self.tiles, self.scale, self.causal, self.window_size, self.stats = (
            q, tiles, scale, causal, window_size, stats)
        self.out = mx.zeros((b, hq, q_len, value_dim), mx.float32)
        first_lse = (mx.full((b, hq, 1), -mx.inf) if sinks is None
                     else sinks.astype(mx.float32).reshape(1, hq, 1))
        self.lse = {tile: mx.broadcast_to(first_lse, (b, hq, tile[1])) for tile in tiles}

    def attend(self, kp: mx.array, vp: mx.array, k_start: int) -> None:
        """Merges the attention of every query tile to the keys ``kp`` (at
        ``k_start`` in the sequence) and values ``vp`` it sees."""
        causal, window_size = self.causal, self.window_size
        for tile in self.tiles:
            q_start, length, offset = tile
            kind = _block_kind(q_start, length, k_start, kp.shape[2], causal, window_size)
            if kind == "skip":
                continue
            block_mask = _block_mask(kind, q_start, length, k_start, kp.shape[2], window_size)
            rows = slice(offset, offset + length)
            merged, self.lse[tile] = merge_partials(
                self.out[:, :, rows], self.lse[tile],
                *_attend_block(self.q[:, :, rows], kp, vp, scale=self.scale, mask=block_mask,
                               window_size=window_size),
            )
            mx.eval(merged, self.lse[tile])  # one tile's partial alive at a time
            self.out[:, :, rows] = merged  # in place: `out` has no other reference
            del merged
            mx.eval(self.out)
            if self.stats is not None:
                self.stats.visible_pairs += _visible_pairs(q_start, length, k_start, kp.shape[2], causal,
                                                           window_size)


def _exchange(rounds, group, k, v, attend, timeout, stats):
    """Runs the schedule of :func:`_ring_schedule`: each round a rank sends
    one piece to rank+1 and receives one from rank-1 (and attends to it if
    its queries see it). Even ranks send first, odd ranks receive first:
    MLX's ring send/recv block, so all-send-first would deadlock."""
    ranks, rank = group.size(), group.rank()
    right, left = (rank + 1) % ranks, (rank - 1) % ranks
    held = None  # (piece, k, v) received last round

    def send(piece: _Piece, what: str):
        if piece.source == rank:  # an own piece is a strided view: send a short-lived contiguous copy
            arrays = [mx.contiguous(a[:, :, piece.offset : piece.offset + piece.length]) for a in (k, v)]
        elif held is not None and held[0] == piece:
            arrays = list(held[1:])
        else:  # the schedule forwards only what arrived the round before
            raise RuntimeError(f"ring schedule broken on rank {rank}: {piece} was not received last round")
        for a in arrays:
            sent = mx.distributed.send(a, right, group=group)
            communicate(f"{what}: sending to rank {right}", [sent], group, timeout)
            if stats is not None:
                stats.bytes_sent += a.nbytes

    def receive(piece: _Piece, what: str):
        parts = []
        for like in (k, v):
            part = mx.distributed.recv((*like.shape[:2], piece.length, like.shape[3]), like.dtype, left, group=group)
            communicate(f"{what}: receiving from rank {left}", [part], group, timeout)
            parts.append(part)
            if stats is not None:
                stats.bytes_received += part.nbytes
        return (piece, *parts)

    seen = set()
    for index, pieces in enumerate(rounds):
        what = f"ring round {index + 1} of {len(rounds)}"
        outgoing, incoming = pieces[rank], pieces[left]
        arrived = None
        if rank % 2 and incoming is not None:
            arrived = receive(incoming, what)
        if outgoing is not None:
            send(outgoing, what)
        if rank % 2 == 0 and incoming is not None:
            arrived = receive(incoming, what)
        held = arrived  # the piece sent this round (if forwarded) is no longer needed
        if arrived is not None:
            attend(arrived[1], arrived[2], incoming.start)
            if stats is not None and incoming.source not in seen:
                seen.add(incoming.source)
                stats.ring_steps += 1
