"""The native kernels' per-op entry points (`engine.native.ops`) against the plain-torch computations they
replace: packed products with odd sizes and biases, the fused MoE (routing, per-token k, renormalisation),
paged decode attention (GQA, windows, scattered blocks), the fused residual RMSNorm and RoPE + cache write;
the same results on one thread and two; and the build cache. The one-call decode kernel is tested layer by
layer in test_decode_layers.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import engine.native.build as build
from engine.attention import AttentionContext, _decode, plan_paged, write_kv
from engine.moe import ExpertCount, grouped_moe, route
from engine.native import ops
from engine.rope import apply_rotary


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(("m", "k", "n"), [(1, 768, 2560), (3, 100, 37), (7, 33, 64), (16, 256, 130), (64, 64, 200)])
def test_packed_linear_equals_f_linear(m: int, k: int, n: int, threads: int) -> None:
    x = torch.randn(m, k, generator=_gen(m))
    w = torch.randn(n, k, generator=_gen(n))
    b = torch.randn(n, generator=_gen(k))
    packed = ops.pack(w)
    assert packed.data.numel() == -(-n // ops.PANEL) * ops.PANEL * k
    for bias in (None, b):
        torch.testing.assert_close(ops.linear(x, packed, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


def test_pack_leaves_the_source_and_reads_any_layout() -> None:
    w = torch.randn(70, 40, generator=_gen(1))
    column_major = w.t().contiguous().t()
    before = w.clone()
    x = torch.randn(2, 40, generator=_gen(2))
    torch.testing.assert_close(ops.linear(x, ops.pack(column_major)), x @ w.T, rtol=1e-5, atol=1e-5)
    assert torch.equal(w, before)


@pytest.mark.parametrize("tokens", [1, 2, 7, 16])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("mixed_k", [False, True])
def test_fused_moe_equals_route_and_grouped_moe(tokens: int, normalize: bool, mixed_k: bool, threads: int) -> None:
    e, h, i = 8, 96, 80
    x = torch.randn(tokens, h, generator=_gen(tokens))
    router = torch.randn(e, h, generator=_gen(3))
    gate_up = 0.1 * torch.randn(e, 2 * i, h, generator=_gen(4))
    down = 0.1 * torch.randn(e, h, i, generator=_gen(5))
    per_token = torch.randint(1, 4, (tokens,), generator=_gen(6)) if mixed_k else None
    k_max = 3 if mixed_k else 2
    weights, ids = route(x @ router.T, ExpertCount(k_max, per_token), normalize, x.dtype)
    expected = grouped_moe(x, gate_up, down, weights, ids, per_token)
    got = ops.moe(x, router, ops.pack(gate_up), ops.pack(down), k_max, per_token, normalize)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 8])
def test_paged_decode_equals_torch_decode(window: int | None, threads: int) -> None:
    batch, n_q, n_kv, d, block, blocks = 3, 8, 2, 32, 16, 20
    k_cache = torch.randn(blocks, block, n_kv, d, generator=_gen(1))
    v_cache = torch.randn(blocks, block, n_kv, d, generator=_gen(2))
    lens = torch.tensor([5, 33, 17])
    tables = torch.tensor([[3, -1, -1], [0, 7, 9], [11, 2, -1]])
    q = torch.randn(batch, n_q, d, generator=_gen(3))
    ctx = AttentionContext(False, torch.arange(batch + 1), lens, torch.zeros(batch, dtype=torch.long), tables)
    plan = plan_paged(ctx, block)
    with torch.inference_mode():
        got = ops.paged_decode(q, k_cache, v_cache, tables, lens, 0.17, window)
        expected = _decode(q, k_cache, v_cache, plan, 0.17, window)  # the torch model's decode attention
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [32, 24, 64, 128])
@pytest.mark.parametrize("window", [None, 21, 40])
@pytest.mark.parametrize("n_q", [8, 6, 10])
def test_paged_decode_over_many_blocks_equals_torch_decode(d: int, window: int | None, n_q: int, threads: int) -> None:
    """Contexts spanning many scattered blocks and ending mid-block, windows starting mid-block (at 40, the keys past
    the first 32, which the kernel prefetches as it scores, cross a block), three to five query heads per KV head
    (the weighted V rows go four heads at a time), head sizes on and off the 16-lane path (64 and 128: a key's
    scores from its row loaded once): the kernel walks the cache block by block."""
    batch, n_kv, block, blocks = 4, 2, 16, 40
    k_cache = torch.randn(blocks, block, n_kv, d, generator=_gen(4))
    v_cache = torch.randn(blocks, block, n_kv, d, generator=_gen(5))
    lens = torch.tensor([1, 16, 97, 130])
    order = torch.randperm(blocks, generator=_gen(6))
    tables = torch.stack([order[i * 9:i * 9 + 9] for i in range(batch)])
    q = torch.randn(batch, n_q, d, generator=_gen(7))
    ctx = AttentionContext(False, torch.arange(batch + 1), lens, torch.zeros(batch, dtype=torch.long), tables)
    with torch.inference_mode():
        got = ops.paged_decode(q, k_cache, v_cache, tables, lens, 0.3, window)
        expected = _decode(q, k_cache, v_cache, plan_paged(ctx, block), 0.3, window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_add_rmsnorm_updates_the_residual_and_normalises() -> None:
    h = torch.randn(3, 200, generator=_gen(1))
    delta = torch.randn(3, 200, generator=_gen(2))
    weight = torch.rand(200, generator=_gen(3)) + 0.5
    expected_h = h + delta
    expected = F.rms_norm(expected_h, (200,), weight, 1e-6)
    out = ops.add_rmsnorm(h, delta, weight, 1e-6)
    torch.testing.assert_close(h, expected_h)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ops.add_rmsnorm(h, None, weight, 1e-6), expected, rtol=1e-5, atol=1e-6)


def test_rope_write_kv_equals_apply_rotary_and_write_kv() -> None:
    t, n_q, n_kv, d, block, blocks = 3, 4, 2, 16, 4, 6
    qkv = torch.randn(t, (n_q + 2 * n_kv) * d, generator=_gen(1))
    angles = torch.randn(t, d // 2, generator=_gen(2))
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    slots = torch.tensor([5, 17, 2])
    caches = [torch.zeros(blocks, block, n_kv, d) for _ in range(4)]
    q = ops.rope_write_kv(qkv, n_q, n_kv, d, cos, sin, caches[0], caches[1], slots)
    heads = qkv.view(t, n_q + 2 * n_kv, d)
    expected_q = apply_rotary(heads[:, :n_q], cos, sin)
    write_kv(caches[2], caches[3], apply_rotary(heads[:, n_q:n_q + n_kv], cos, sin), heads[:, n_q + n_kv:], slots)
    torch.testing.assert_close(q, expected_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(caches[0], caches[2], rtol=1e-6, atol=1e-6)
    assert torch.equal(caches[1], caches[3])


@pytest.mark.process
@pytest.mark.slow
def test_build_is_cached_per_source_and_rebuilt_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERGATE_NATIVE_CACHE", str(tmp_path))
    first = build.build()
    assert first.parent == tmp_path and first.is_file()
    stamp = first.stat().st_mtime_ns
    assert build.build() == first and first.stat().st_mtime_ns == stamp  # cached: not rebuilt
    monkeypatch.setattr(build, "_cpu_fingerprint", lambda: "another machine")
    assert build.build() != first  # a different CPU gets its own build
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


@pytest.mark.process
def test_a_failed_build_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERGATE_NATIVE_CACHE", str(tmp_path))
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(build, "SOURCE", broken)
    with pytest.raises(build.BuildError, match="failed"):
        build.build()


@pytest.mark.parametrize(("m", "k", "n"), [(1, 768, 2560), (3, 100, 37), (16, 256, 130)])
def test_bf16_panels_equal_f_linear_on_the_rounded_weights(m: int, k: int, n: int, threads: int) -> None:
    x = torch.randn(m, k, generator=_gen(m))
    w = torch.randn(n, k, generator=_gen(n))
    b = torch.randn(n, generator=_gen(k))
    packed = ops.pack(w, bf16=True)
    assert packed.bf16 and packed.data.numel() * 4 == -(-n // ops.PANEL) * ops.PANEL * k * 2  # half the bytes
    rounded = w.bfloat16().float()
    for bias in (None, b):
        torch.testing.assert_close(ops.linear(x, packed, bias), F.linear(x, rounded, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("k, n", [(200, 130), (520, 2100)])
@pytest.mark.parametrize("bf16", [False, True])
def test_each_row_of_a_batch_is_the_row_computed_alone(bf16: bool, threads: int, k: int, n: int) -> None:
    """Bit for bit: a speculative verify's rows, and continuous batching, must give what one sequence decoding
    alone gets (greedy identity). Batches of every tile shape, chunks beyond one register tile, K across
    several cache blocks and a partial panel; 520 x 2100 is over 1 MiB a thread even in bf16 on two threads,
    where the AVX2 passes after a block's first prefetch the next block (TG_NEXT_MIN)."""
    w, b = torch.randn(n, k, generator=_gen(7)), torch.randn(n, generator=_gen(8))
    x = torch.randn(40, k, generator=_gen(9))
    packed = ops.pack(w, bf16=bf16)
    alone = torch.cat([ops.linear(x[i:i + 1], packed, b) for i in range(40)])
    for m in (2, 3, 4, 5, 6, 7, 8, 16, 25, 40):
        assert torch.equal(ops.linear(x[:m], packed, b), alone[:m]), m


def test_bf16_moe_equals_the_fp32_kernel_on_bf16_exact_weights() -> None:
    e, h, i, tokens = 8, 64, 96, 5
    x = torch.randn(tokens, h, generator=_gen(1))
    router = torch.randn(e, h, generator=_gen(2))
    gate_up = (0.1 * torch.randn(e, 2 * i, h, generator=_gen(3))).bfloat16().float()
    down = (0.1 * torch.randn(e, h, i, generator=_gen(4))).bfloat16().float()
    fp32 = ops.moe(x, router, ops.pack(gate_up), ops.pack(down), 2, None, True)
    bf16 = ops.moe(x, router, ops.pack(gate_up, bf16=True), ops.pack(down, bf16=True), 2, None, True)
    torch.testing.assert_close(bf16, fp32, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="same format"):
        ops.moe(x, router, ops.pack(gate_up, bf16=True), ops.pack(down), 2, None, True)


SILU_EDGES = (-100.0, -88.5, -87.5, -30.0, -1.0, -1e-3, 0.0, 1e-3, 1.0, 20.0, 88.5, 100.0)


def silu_inputs(g: torch.Generator) -> torch.Tensor:
    """Rows of 43 columns (the vector lanes, then a scalar tail): the edges where exp overflows or vanishes, and
    random values."""
    return torch.cat([torch.tensor(SILU_EDGES).repeat(4)[:43][None], 8 * torch.randn(6, 43, generator=g)])


def swiglu_of_identity(x: torch.Tensor) -> torch.Tensor:
    """One expert whose gate, up and down projections are identities: the fused MoE's output is its SwiGLU
    activation silu(x) * x, element by element (the products with 0 / 1 weights are exact)."""
    n = x.shape[1]
    eye = torch.eye(n)
    return ops.moe(x, torch.zeros(1, n), ops.pack(torch.cat([eye, eye])[None]), ops.pack(eye[None]), 1, None, True)


def test_the_swiglu_activation_matches_torch_over_the_whole_range(threads: int) -> None:
    """silu_mul's vector exp (16 / 8 lanes, then a scalar tail: 43 columns) against torch, at the edges where
    exp overflows or vanishes and on random values."""
    x = silu_inputs(torch.Generator().manual_seed(11))
    torch.testing.assert_close(swiglu_of_identity(x), F.silu(x) * x, rtol=1e-6, atol=1e-30)


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_the_portable_build_without_avx512_computes_the_same(tmp_path: Path, march: str) -> None:
    """The kernels' non-AVX-512 code paths (what a machine without AVX-512 compiles: the AVX2 + FMA panel and
    quantized kernels on x86-64-v3, plain C loops on x86-64), checked against torch in a fresh process."""
    import platform
    import subprocess
    import sys

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"{march} is an x86 target")
    check = (
        "import torch, torch.nn.functional as F\n"
        "from engine.native import ops\n"
        "assert ops.available(), ops.reason()\n"
        "assert ops._lib.tg_has_avx512() == 0\n"
        "g = torch.Generator().manual_seed(0)\n"
        "w, b = torch.randn(130, 70, generator=g), torch.randn(130, generator=g)\n"
        "for m in (1, 2, 5, 7):  # one token (a whole panel row), and tiles of three over panel halves\n"
        "    x = torch.randn(m, 70, generator=g)\n"
        "    for bf16 in (False, True):\n"
        "        ref = F.linear(x, w.bfloat16().float() if bf16 else w, b)\n"
        "        torch.testing.assert_close(ops.linear(x, ops.pack(w, bf16=bf16), b), ref, rtol=1e-5, atol=1e-4)\n"
        "x = torch.randn(30, 70, generator=g)  # every row of a batch as the row alone: same sums, same order\n"
        "for bf16 in (False, True):\n"
        "    p = ops.pack(w, bf16=bf16)\n"
        "    alone = torch.cat([ops.linear(x[i:i + 1], p, b) for i in range(30)])\n"
        "    for m in (2, 3, 4, 5, 7, 30):\n"
        "        assert torch.equal(ops.linear(x[:m], p, b), alone[:m]), (bf16, m)\n"
        "wl, xl = torch.randn(2100, 520, generator=g), torch.randn(8, 520, generator=g)  # > 1 MiB: next-block prefetch\n"
        "for bf16 in (False, True):\n"
        "    p = ops.pack(wl, bf16=bf16)\n"
        "    alone = torch.cat([ops.linear(xl[i:i + 1], p) for i in range(8)])\n"
        "    for m in (2, 4, 6, 8):\n"
        "        assert torch.equal(ops.linear(xl[:m], p), alone[:m]), (bf16, m)\n"
        "from engine import quant\n"
        "for m in (1, 5):\n"
        "    xq = torch.randn(m, 96, generator=g)\n"
        "    for fmt in ('q8_0', 'q4_0'):\n"
        "        blocks = quant.quantize(torch.randn(70, 96, generator=g), fmt)\n"
        "        ref = quant.reference_linear(xq, blocks, fmt, b[:70])\n"
        "        got = ops.linear(xq, ops.pack_blocks(blocks, fmt), b[:70])\n"
        "        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)\n"
        "xa = torch.randn(9, 160, generator=g) * 3\n"
        "d, q = ops.quantize_rows_q8(xa)\n"
        "d_ref, q_ref = quant.quantize_activations(xa)\n"
        "assert torch.equal(d, d_ref) and torch.equal(q, q_ref)\n"
        "from tests.engine.native.test_native import silu_inputs, swiglu_of_identity\n"
        "xs = silu_inputs(g)\n"
        "torch.testing.assert_close(swiglu_of_identity(xs), F.silu(xs) * xs, rtol=1e-6, atol=1e-30)\n"
        "kc, vc = torch.randn(3, 16, 2, 32, generator=g), torch.randn(3, 16, 2, 32, generator=g)\n"
        "qd = torch.randn(1, 4, 32, generator=g)  # one sequence of 37 keys in blocks 2, 0, 1; 2 query heads per KV head\n"
        "got = ops.paged_decode(qd, kc, vc, torch.tensor([[2, 0, 1]]), torch.tensor([37]), 0.2, None)\n"
        "keys, vals = (c[[2, 0, 1]].reshape(48, 2, 32)[:37].repeat_interleave(2, dim=1) for c in (kc, vc))\n"
        "w = torch.softmax(torch.einsum('hd,thd->ht', qd[0], keys) * 0.2, dim=-1)\n"
        "torch.testing.assert_close(got[0], torch.einsum('ht,thd->hd', w, vals), rtol=1e-5, atol=1e-5)\n"
        "h = torch.randn(3, 70, generator=g)\n"
        "torch.testing.assert_close(ops.add_rmsnorm(h.clone(), None, torch.ones(70), 1e-6),\n"
        "                           F.rms_norm(h, (70,), torch.ones(70), 1e-6), rtol=1e-5, atol=1e-6)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "TIERGATE_NATIVE_MARCH": march, "TIERGATE_NATIVE_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300,
                          check=False, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
