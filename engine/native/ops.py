"""The C entry points of the native kernels (`tg_kernels.c`), loaded with ctypes: one wrapper per kernel.

`available()` says whether they can be used here; the first call compiles the library if this
machine has no cached build (see `engine.native.build`). When they cannot (no C compiler, a
failed build, ``TIERGATE_ENGINE_NATIVE=0``), the runner keeps the plain-torch model, which
computes the same thing; ``reason()`` says why.

The wrappers take torch tensors, check what the kernels assume (fp32, CPU, the strides they
index with) and return new tensors. They run with ``torch.get_num_threads()`` threads on
PyTorch's own OpenMP pool (a one-call decode step: that many or one, whichever its `ThreadChoice` measured
faster). `decode_layers` runs a whole decode step from a `LayerSpec` array
(`engine.native.layers` builds it from the model); `DecodeStepCall` runs one from token ids to logits
(`engine.native.step` builds it).

Must not import the model, the scheduler, or anything outside torch and the standard library.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

import torch

from engine.native import build as _build
from engine.native.threads import ThreadChoice

log = logging.getLogger(__name__)

ABI_VERSION = 14
PANEL = 64  # outputs per packed panel (tg_kernels.c)
BLOCK = 32  # elements per quantized block
# weight formats (tg_kernels.c): fp32 / bf16 panels, ggml Q8_0 / Q4_0 blocks interleaved in 16-row groups
F32, BF16, Q8_0, Q4_0 = 0, 1, 2, 3
FORMAT_NAMES = {F32: "fp32", BF16: "bf16", Q8_0: "q8_0", Q4_0: "q4_0"}
BLOCK_FORMATS = {"q8_0": Q8_0, "q4_0": Q4_0}
_BLOCK_BYTES = {Q8_0: 34, Q4_0: 18}
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_state: str | None = None  # None: not tried yet; "" loaded; else why not

_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_int = ctypes.c_int
_f32 = ctypes.c_float


class LayerSpec(ctypes.Structure):
    """One decoder layer for `decode_layers` (mirrors ``tg_layer`` in tg_kernels.c): raw pointers into the
    model's packed weights, norms and KV cache; NULL where a layer has no such part."""

    _fields_ = [
        ("input_norm", _p), ("post_norm", _p), ("eps", _f32), ("fmt", _int),
        ("qkv", _p), ("qkv_bias", _p), ("o", _p), ("o_bias", _p),
        ("n_q", _i64), ("n_kv", _i64), ("head_dim", _i64), ("window", _i64), ("scale", _f32),
        ("router", _p), ("gate_up", _p), ("down", _p), ("num_experts", _i64), ("moe_intermediate", _i64),
        ("normalize", _int),
        ("mlp_gate_up", _p), ("mlp_gate_up_bias", _p), ("mlp_down", _p), ("mlp_down_bias", _p),
        ("mlp_intermediate", _i64),
        ("k_cache", _p), ("v_cache", _p),
    ]


class ModelSpec(ctypes.Structure):
    """What `DecodeStepCall` reads besides the layers (mirrors ``tg_model`` in tg_step.c): the embedding table,
    RoPE tables [positions, rope_dim], the final norm and the packed LM head."""

    _fields_ = [
        ("embed", _p), ("cos", _p), ("sin", _p), ("n_positions", _i64), ("rope_dim", _i64),
        ("final_norm", _p), ("final_eps", _f32), ("lm_fmt", _int), ("lm_head", _p), ("vocab", _i64), ("hidden", _i64),
    ]


class BatchSpec(ctypes.Structure):
    """One decode step's batch for `DecodeStepCall` (mirrors ``tg_batch``): B sequences' token ids, positions
    and block tables [B, width] (int64, -1 padded), expert counts (int32 per sequence, or NULL: k_max), and
    where each row's argmax goes (int64 [B], or NULL)."""

    _fields_ = [
        ("B", _i64), ("width", _i64), ("block_size", _i64), ("tokens", _p), ("positions", _p), ("tables", _p),
        ("k_max", _int), ("k_per_token", _p), ("argmax", _p),
    ]


def _load() -> None:
    global _lib, _state
    if os.environ.get("TIERGATE_ENGINE_NATIVE", "1") == "0":
        _state = "turned off by TIERGATE_ENGINE_NATIVE=0"
        return
    try:
        path = _build.build()
        lib = ctypes.CDLL(str(path))
    except (_build.BuildError, OSError) as exc:
        _state = f"native kernels unavailable: {exc}"
        log.warning("%s; the engine uses its plain-torch kernels", _state)
        return
    if lib.tg_abi_version() != ABI_VERSION:
        _state = f"native library {path} has ABI {lib.tg_abi_version()}, expected {ABI_VERSION}"
        log.warning("%s; the engine uses its plain-torch kernels", _state)
        return
    lib.tg_pack.argtypes = [_p, _i64, _i64, _i64, _p]
    lib.tg_pack.restype = None
    lib.tg_pack_bf16.argtypes = [_p, _i64, _i64, _i64, _p]
    lib.tg_pack_bf16.restype = None
    lib.tg_linear.argtypes = [_p, _i64, _i64, _i64, _p, _int, _i64, _p, _p, _i64, _int]
    lib.tg_linear.restype = _int
    lib.tg_pack_q.argtypes = [_p, _int, _i64, _i64, _p]
    lib.tg_pack_q.restype = None
    lib.tg_packed_q_bytes.argtypes = [_int, _i64, _i64]
    lib.tg_packed_q_bytes.restype = _i64
    lib.tg_quantize_rows_q8.argtypes = [_p, _i64, _i64, _i64, _p, _p]
    lib.tg_quantize_rows_q8.restype = None
    lib.tg_moe.argtypes = [_p, _i64, _i64, _p, _i64, _p, _p, _int, _i64, _int, _p, _int, _p, _int]
    lib.tg_moe.restype = _int
    lib.tg_paged_decode.argtypes = [_p, _p, _p, _p, _i64, _p, _i64, _i64, _i64, _i64, _i64, _f32, _i64, _p, _int]
    lib.tg_paged_decode.restype = _int
    lib.tg_add_rmsnorm.argtypes = [_p, _p, _p, _i64, _i64, _f32, _p]
    lib.tg_add_rmsnorm.restype = None
    lib.tg_rope_write_kv.argtypes = [_p, _i64, _i64, _i64, _i64, _p, _p, _p, _p, _p, _p]
    lib.tg_rope_write_kv.restype = None
    lib.tg_advise_huge.argtypes = [_p, _i64]
    lib.tg_advise_huge.restype = _int
    lib.tg_stream_sum.argtypes = [_p, _i64, _int]
    lib.tg_stream_sum.restype = ctypes.c_double
    lib.tg_set_row_prefetch.argtypes = [_int, _i64]
    lib.tg_set_row_prefetch.restype = _i64
    lib.tg_row_prefetch.argtypes = [_int]
    lib.tg_row_prefetch.restype = _i64
    lib.tg_set_prefetch_level.argtypes = [_int]
    lib.tg_set_prefetch_level.restype = _int
    lib.tg_prefetch_level.restype = _int
    lib.tg_has_avx512.restype = _int
    lib.tg_layer_size.restype = _int
    if lib.tg_layer_size() != ctypes.sizeof(LayerSpec):
        _state = f"native library {path} lays out tg_layer in {lib.tg_layer_size()} bytes, ctypes in {ctypes.sizeof(LayerSpec)}"
        log.warning("%s; the engine uses its plain-torch kernels", _state)
        return
    lib.tg_decode_layers.argtypes = [_p, _int, _p, _i64, _i64, _p, _p, _p, _p, _i64, _p, _i64, _int, _p, _p, _f32, _p,
                                     _int]
    lib.tg_decode_layers.restype = _int
    lib.tg_model_size.restype = _int
    if lib.tg_model_size() != ctypes.sizeof(ModelSpec):
        _state = f"native library {path} lays out tg_model in {lib.tg_model_size()} bytes, ctypes in {ctypes.sizeof(ModelSpec)}"
        log.warning("%s; the engine uses its plain-torch kernels", _state)
        return
    lib.tg_batch_size.restype = _int
    if lib.tg_batch_size() != ctypes.sizeof(BatchSpec):
        _state = f"native library {path} lays out tg_batch in {lib.tg_batch_size()} bytes, ctypes in {ctypes.sizeof(BatchSpec)}"
        log.warning("%s; the engine uses its plain-torch kernels", _state)
        return
    lib.tg_decode_step.argtypes = [_p, _p, _int, _p, _p, _int]
    lib.tg_decode_step.restype = _int
    lib.tg_argmax_rows.argtypes = [_p, _i64, _i64, _p]
    lib.tg_argmax_rows.restype = None
    _lib, _state = lib, ""


def available() -> bool:
    """True when the native kernels are loaded (building them on first use)."""
    if _state is None:
        with _lock:
            if _state is None:
                _load()
    return _lib is not None


def reason() -> str:
    """Why the native kernels are not in use ('' when they are)."""
    available()
    return _state or ""


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class Packed:
    """A weight matrix W[N, K] (or a stack of E of them) as the kernels read it: 64-output panels of fp32 or
    bf16 elements, or ggml Q8_0 / Q4_0 blocks in 16-row groups (``fmt``, see `pack_blocks`)."""

    __slots__ = ("data", "fmt", "k", "n")

    def __init__(self, data: torch.Tensor, n: int, k: int, bf16: bool = False, fmt: int | None = None) -> None:
        self.data, self.n, self.k = data, n, k
        self.fmt = fmt if fmt is not None else (BF16 if bf16 else F32)

    @property
    def bf16(self) -> bool:
        return self.fmt == BF16

    @property
    def quantized(self) -> bool:
        return self.fmt in (Q8_0, Q4_0)

    @property
    def format_name(self) -> str:
        return FORMAT_NAMES[self.fmt]


_HUGE = 2 << 20


def empty_huge(numel: int) -> torch.Tensor:
    """An uninitialised fp32 tensor of ``numel`` elements whose pages the kernel is asked to back with
    transparent huge pages (before anything touches them). Decode streams the weights every step, and
    with 4 KiB pages the TLB misses cost about a third of the bandwidth here."""
    assert _lib is not None
    if numel * 4 < 4 * _HUGE:
        return torch.empty(numel, dtype=torch.float32)
    base = torch.empty(numel + _HUGE // 4, dtype=torch.float32)
    skip = (-base.data_ptr() % _HUGE) // 4
    out = base[skip:skip + numel]  # 2 MiB-aligned start; `base` lives on as the view's storage
    _lib.tg_advise_huge(out.data_ptr(), numel * 4)
    return out


def pack(weight: torch.Tensor, bf16: bool = False) -> Packed:
    """Repack W[N, K] (or [E, N, K]) into 64-output panels (bf16 elements, rounded to nearest even, with
    ``bf16``: half the bytes to stream, exact for a bf16 checkpoint); the source is left as it is."""
    assert _lib is not None
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() not in (2, 3):
        raise ValueError("pack takes an fp32 CPU matrix [N, K] or stack [E, N, K]")
    stack = weight if weight.dim() == 3 else weight[None]
    e, n, k = stack.shape
    panels = -(-n // PANEL)
    per = panels * k * PANEL
    words = -(-per // 2) if bf16 else per  # bf16 panels stored two to an fp32 word
    data = empty_huge(e * words).view(e, words)
    for i in range(e):
        w = stack[i] if stack[i].stride(-1) == 1 else stack[i].contiguous()
        (_lib.tg_pack_bf16 if bf16 else _lib.tg_pack)(w.data_ptr(), n, k, w.stride(0), data[i].data_ptr())
    return Packed(data if weight.dim() == 3 else data[0], n, k, bf16)


def pack_blocks(blocks: torch.Tensor, fmt: str) -> Packed:
    """Q8_0 / Q4_0 blocks (uint8 [N, K / 32 * block_bytes] or [E, N, ...], ggml's row-major layout, see
    `engine.quant`) repacked into a huge-page buffer the kernels stream: rows in groups of 16, each block's 16
    scales then its quants interleaved four bytes at a time (``tg_pack_q``; the same bytes, rows padded to a
    whole group); ``fmt`` ``"q8_0"`` or ``"q4_0"``."""
    assert _lib is not None
    code = BLOCK_FORMATS.get(fmt)
    if code is None or blocks.dtype != torch.uint8 or blocks.dim() not in (2, 3):
        raise ValueError("pack_blocks takes uint8 q8_0 / q4_0 blocks [N, bytes] or [E, N, bytes]")
    size = _BLOCK_BYTES[code]
    if blocks.shape[-1] % size:
        raise ValueError(f"{fmt} rows must be whole {size}-byte blocks")
    stack = blocks if blocks.dim() == 3 else blocks[None]
    e, n, row_bytes = stack.shape
    k = row_bytes // size * BLOCK
    per = int(_lib.tg_packed_q_bytes(code, n, k))
    words = empty_huge(-(-e * per // 4))
    data = words.view(torch.uint8)[: e * per].view(e, per)
    for i in range(e):
        src = stack[i].contiguous()
        _lib.tg_pack_q(src.data_ptr(), code, n, k, data[i].data_ptr())
    return Packed(data if blocks.dim() == 3 else data[0], n, k, fmt=code)


def quantize_rows_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' activation quantizer: x [M, K] fp32 -> (scales [M, K / 32], int8 [M, K])."""
    assert _lib is not None
    m, k = x.shape
    if k % BLOCK or x.dtype != torch.float32 or x.stride(-1) != 1:
        raise ValueError("quantize_rows_q8 takes fp32 rows of whole 32-element blocks")
    d = torch.empty(m, k // BLOCK, dtype=torch.float32)
    q = torch.empty(m, k, dtype=torch.int8)
    _lib.tg_quantize_rows_q8(x.data_ptr(), m, k, x.stride(0), d.data_ptr(), q.data_ptr())
    return d, q


def linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None,
           threads: int | None = None) -> torch.Tensor:
    """x [M, K] . W^T (+ bias) -> [M, N] with W packed; x fp32 on the CPU with unit stride along K (rows may be
    strided), bias fp32 contiguous; on ``threads`` threads (default ``torch.get_num_threads()``)."""
    assert _lib is not None
    m, k = x.shape
    if k != packed.k:
        raise ValueError(f"x has {k} columns, the packed matrix {packed.k}")
    n = packed.n
    y = torch.empty(m, n, dtype=torch.float32)
    rc = _lib.tg_linear(x.data_ptr(), m, k, x.stride(0), packed.data.data_ptr(), packed.fmt, n, _ptr(bias),
                        y.data_ptr(), n, threads or torch.get_num_threads())
    if rc != 0:
        raise MemoryError("tg_linear could not allocate its work buffers")
    return y


def moe(x: torch.Tensor, router: torch.Tensor, gate_up: Packed, down: Packed, k_max: int,
        per_token: torch.Tensor | None, normalize: bool) -> torch.Tensor:
    """Routed experts for x [M, H] (see `tg_moe`): router [E, H]; gate_up packs [E, 2I, H], down [E, H, I]."""
    assert _lib is not None
    if gate_up.fmt != down.fmt:
        raise ValueError("gate_up and down must be packed in the same format")
    m, h = x.shape
    x = x.contiguous()
    router = router.contiguous()
    ks = None if per_token is None else per_token.to(torch.int32).contiguous()
    y = torch.empty(m, h, dtype=torch.float32)
    rc = _lib.tg_moe(x.data_ptr(), m, h, router.data_ptr(), router.shape[0], gate_up.data.data_ptr(),
                     down.data.data_ptr(), gate_up.fmt, gate_up.n // 2, k_max, _ptr(ks), int(normalize),
                     y.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("tg_moe could not allocate its work buffers")
    return y


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """q [B, Hq, D] against the paged cache [num_blocks, block_size, Hkv, D] -> [B, Hq, D]."""
    assert _lib is not None
    b, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    rc = _lib.tg_paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                              tables.shape[1], lens.data_ptr(), b, hq, hkv, d, block_size, scale, window or 0,
                              out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("tg_paged_decode could not allocate its work buffers")
    return out


def add_rmsnorm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` in place (h [M, H] contiguous fp32), then return ``rms_norm(h) * weight``."""
    assert _lib is not None
    m, hidden = h.shape
    if delta is not None:
        delta = delta.contiguous()
    x = torch.empty_like(h)
    _lib.tg_add_rmsnorm(h.data_ptr(), _ptr(delta), weight.data_ptr(), m, hidden, eps, x.data_ptr())
    return x


def rope_write_kv(qkv: torch.Tensor, n_q: int, n_kv: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rotate q/k of qkv [T, (Hq + 2 Hkv) D] with cos/sin [T, D], write k and v into the paged cache at
    ``slots`` [T]; returns the rotated q [T, Hq, D]."""
    assert _lib is not None
    t = qkv.shape[0]
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    slots = slots.to(torch.int64).contiguous()
    q = torch.empty(t, n_q, head_dim, dtype=torch.float32)
    _lib.tg_rope_write_kv(qkv.data_ptr(), t, n_q, n_kv, head_dim, cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
                          k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr())
    return q


def argmax_rows(x: torch.Tensor) -> list[int]:
    """Each row's argmax of x [rows, n] (contiguous fp32, n >= 1) as `tg_decode_step` picks greedy tokens:
    torch.argmax's answer (the first maximum, or the first NaN)."""
    assert _lib is not None
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or x.shape[1] < 1:
        raise ValueError("argmax_rows takes contiguous fp32 rows [rows, n >= 1]")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _lib.tg_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out.tolist()  # type: ignore[no-any-return]


def library() -> ctypes.CDLL:
    """The loaded library, for the module that sets its process-wide prefetch knobs (`engine.native.prefetch`)."""
    assert _lib is not None
    return _lib


def stream_sum(x: torch.Tensor) -> float:
    """Sum of a contiguous fp32 CPU tensor, read once with ``torch.get_num_threads()`` threads."""
    assert _lib is not None
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError("stream_sum takes a contiguous fp32 CPU tensor")
    return float(_lib.tg_stream_sum(x.data_ptr(), x.numel(), torch.get_num_threads()))


class DecodeLayers:
    """A model's layers as a `LayerSpec` array for `decode_layers`. It holds the tensors it points into, so
    they live as long as it does; build a new one when the weights or the KV cache tensors change."""

    def __init__(self, specs: list[LayerSpec], keep: list[torch.Tensor]) -> None:
        self.array = (LayerSpec * len(specs))(*specs)
        self.count = len(specs)
        self._keep = keep
        self.threads = ThreadChoice()  # one thread or the team, per batch size (engine.native.threads)


def decode_layers(layers: DecodeLayers, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_slots: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, k_max: int,
                  per_token: torch.Tensor | None, final_norm: torch.Tensor, final_eps: float) -> torch.Tensor:
    """Every layer of a step of one-token rows (a decode step, or a prefill's tokens each with its own block
    table row and context length; h [B, H] updated in place as the residual stream) and the final norm; returns
    the normed hidden states [B, H]."""
    assert _lib is not None
    b, hidden = h.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    slots = ctx_slots.to(torch.int64).contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    ks = None if per_token is None else per_token.to(torch.int32).contiguous()
    out = torch.empty_like(h)
    available = torch.get_num_threads()
    threads = layers.threads.pick(b, available)
    start = time.perf_counter()
    rc = _lib.tg_decode_layers(ctypes.addressof(layers.array), layers.count, h.data_ptr(), b, hidden, cos.data_ptr(),
                               sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
                               block_size, k_max, _ptr(ks), final_norm.data_ptr(), final_eps, out.data_ptr(), threads)
    layers.threads.record(b, available, threads, time.perf_counter() - start)
    if rc != 0:
        raise MemoryError("tg_decode_layers could not allocate its work buffers")
    return out


class DecodeStepCall:
    """`tg_decode_step` bound to a model (`ModelSpec`), its layers (`DecodeLayers`) and a `BatchSpec` the caller
    fills (it points at int64 buffers the caller keeps): logits out. It holds what it points into."""

    def __init__(self, model: ModelSpec, layers: DecodeLayers, batch: BatchSpec, keep: list[object]) -> None:
        assert _lib is not None
        self.model, self.layers, self.batch = model, layers, batch
        self._keep = keep
        self._fn = _lib.tg_decode_step
        self._args = (ctypes.addressof(model), ctypes.addressof(layers.array), layers.count, ctypes.addressof(batch))
        self.threads = ThreadChoice()  # one thread or the team, per batch size (engine.native.threads)

    def __call__(self, logits: torch.Tensor) -> None:
        """Run the step ``batch`` describes; writes ``logits`` [B, vocab] (contiguous fp32)."""
        b = self.batch.B
        available = torch.get_num_threads()
        threads = self.threads.pick(b, available)
        start = time.perf_counter()
        rc = self._fn(*self._args, logits.data_ptr(), threads)
        self.threads.record(b, available, threads, time.perf_counter() - start)
        if rc == -2:
            raise ValueError("a token id, a position or a block-table entry is out of range for this model")
        if rc != 0:
            raise MemoryError("tg_decode_step could not allocate its work buffers")
