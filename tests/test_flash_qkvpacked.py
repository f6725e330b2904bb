"""Packed-QKV FlashAttention (RoPE and the gradient's packing in the kernels) against the split path:
``cs336_basics``' RotaryEmbedding on Q and K, then ``FlashAttentionTriton``.

On CPU the kernels run in Triton's interpreter (set before the first launch), so shapes stay tiny.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cs336_basics.model import BasicsTransformerLM, RotaryEmbedding
from cs336_basics.nn_utils import cross_entropy

from cs336_systems.attention import FlashAttentionTriton, options
from cs336_systems.attention.flash_qkvpacked import FlashAttentionQKVPacked, flash_attention_qkvpacked
from cs336_systems.fused_projections import FusedQKVSelfAttention, fuse_projections

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _one_config():
    with options.use(autotune=False):
        yield


def _tables(rope: RotaryEmbedding, seq: int, positions: torch.Tensor | None = None):
    if positions is None:
        return rope._cos[:seq, :, 0], rope._sin[:seq, :, 1]
    rows = positions.reshape(-1, seq)
    return rope._cos[rows][..., 0], rope._sin[rows][..., 1]


def _split_path(qkv: torch.Tensor, heads: int, rope: RotaryEmbedding, positions, is_causal: bool) -> torch.Tensor:
    batch, seq, width = qkv.shape
    q, k, v = (t.view(batch, seq, heads, -1).transpose(1, 2) for t in qkv.split(width // 3, dim=-1))
    q, k = rope(q, positions), rope(k, positions)
    return FlashAttentionTriton.apply(q, k, v, is_causal)


@pytest.mark.slow
@pytest.mark.parametrize("d, heads, seq, is_causal, per_batch_positions", [
    (16, 2, 37, True, False),   # a ragged last tile
    (16, 3, 24, False, True),   # positions per sequence: (batch, seq, d/2) tables
    (80, 1, 20, True, False),   # two head-dim slabs (64 + 16), d/2 = 40 not a power of two
])  # fmt: skip
def test_packed_attention_matches_rope_then_flash_attention_values_and_gradient(d, heads, seq, is_causal,
                                                                                 per_batch_positions):
    torch.manual_seed(0)
    batch = 2
    rope = RotaryEmbedding(64, d, device=DEVICE)
    # per sequence: (batch, 1, seq), broadcasting over heads as the model's head views need
    positions = torch.stack([torch.randperm(64, device=DEVICE)[:seq] for _ in range(batch)])[:, None] \
        if per_batch_positions else None
    qkv = torch.randn(batch, seq, 3 * heads * d, device=DEVICE, requires_grad=True)
    grad = torch.randn(batch, heads, seq, d, device=DEVICE)

    expected = _split_path(qkv, heads, rope, positions, is_causal)
    (expected_grad,) = torch.autograd.grad(expected, qkv, grad)
    got = flash_attention_qkvpacked(qkv, heads, *_tables(rope, seq, positions), is_causal)
    (got_grad,) = torch.autograd.grad(got, qkv, grad)

    assert got.shape == expected.shape and got_grad.shape == qkv.shape
    # Output memory is token-major: the model's reshape back to (batch, seq, heads·d) is a view.
    assert got.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got_grad, expected_grad, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("d", [32, 128])
def test_the_rotation_kernel_is_cs336_basics_rope_and_its_inverse_undoes_it(d):
    """The kernel alone, forward and inverse in place on a packed (batch, seq, 3, heads, d) tensor: parts 0
    and 1 rotate exactly as RotaryEmbedding does, part 2 (V) is untouched, and the inverse restores the input."""
    from cs336_systems.attention.flash_qkvpacked import _rotate

    torch.manual_seed(1)
    batch, seq, heads = 2, 70, 3  # 70 tokens: a ragged last token tile; d = 32: a ragged column block
    rope = RotaryEmbedding(128, d, device=DEVICE)
    x = torch.randn(batch, seq, 3, heads, d, device=DEVICE)
    y = x.clone()
    cos, sin = _tables(rope, seq)
    _rotate(y, y, cos, sin, inverse=False)
    for part in (0, 1):
        torch.testing.assert_close(y[:, :, part], rope(x[:, :, part].transpose(1, 2)).transpose(1, 2))
    assert torch.equal(y[:, :, 2], x[:, :, 2])
    _rotate(y, y, cos, sin, inverse=True)
    torch.testing.assert_close(y, x)


@pytest.mark.slow
def test_the_fused_model_trains_alike_with_and_without_the_packed_path(monkeypatch):
    torch.manual_seed(0)
    plain = BasicsTransformerLM(vocab_size=40, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=48,
                                attention_impl="flash_triton", device=DEVICE)
    split = fuse_projections(copy.deepcopy(plain), packed_attention=False)
    packed = fuse_projections(copy.deepcopy(plain))
    assert all(layer.attn.packed for layer in packed.layers) and not any(layer.attn.packed for layer in split.layers)
    switched = fuse_projections(copy.deepcopy(plain))
    for layer in switched.layers:
        layer.attn.packed = False  # switched off after fusing: the split path
    x, y = torch.randint(0, 40, (2, 16), device=DEVICE), torch.randint(0, 40, (2, 16), device=DEVICE)
    for model in (split, packed):
        cross_entropy(model(x), y).backward()
    import cs336_systems.fused_projections as fp

    calls = []
    original = fp.flash_attention_qkvpacked
    monkeypatch.setattr(fp, "flash_attention_qkvpacked", lambda *a: calls.append(1) or original(*a))
    torch.testing.assert_close(switched(x), split(x), atol=1e-4, rtol=1e-4)
    assert not calls  # the switched-off blocks took the split path
    packed(x)
    assert len(calls) == len(packed.layers)
    torch.testing.assert_close(packed(x), split(x), atol=1e-4, rtol=1e-4)
    for a, b in zip(split.parameters(), packed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-4, rtol=1e-4)
    # Explicit positions of another shape than (seq,) or (batch, seq) fall back to the split path.
    attn = packed.layers[0].attn
    assert isinstance(attn, FusedQKVSelfAttention) and attn.rope_tables.lookup(16, torch.zeros(2, 16)) is None
    assert attn.rope_tables.lookup(16, torch.zeros(2, 1, 16, dtype=torch.long))[0].shape == (2, 16, 8)


def test_the_packed_tables_are_contiguous_shared_and_stay_out_of_checkpoints():
    """One contiguous (context, d/2) pair of tables per rotary embedding, equal to its per-pair columns, used
    by every block, and no new state-dict keys (checkpoints load into either model)."""
    plain = BasicsTransformerLM(vocab_size=40, context_length=16, d_model=32, num_layers=3, num_heads=2, d_ff=48,
                                attention_impl="flash_triton", device=DEVICE)
    keys = set(plain.state_dict())
    model = fuse_projections(plain)
    tables = {id(layer.attn.rope_tables) for layer in model.layers}
    assert len(tables) == 1
    first = model.layers[0].attn.rope_tables
    rope = model.layers[0].attn.positional_encoder
    assert first.cos.is_contiguous() and first.cos.shape == (16, 8)
    assert torch.equal(first.cos, rope._cos[..., 0]) and torch.equal(first.sin, rope._sin[..., 1])
    cos, sin = first.lookup(5, torch.tensor([[4, 3, 2, 1, 0]]))
    assert cos.is_contiguous() and torch.equal(sin[0, 0], rope._sin[4, :, 1])
    assert set(model.state_dict()) == keys
    # a 16-bit model keeps float32 tables (the kernels' angles), so the packed path still runs
    model.to(torch.bfloat16)
    assert model.layers[0].attn.rope_tables.cos.dtype == torch.float32
    tokens = torch.randint(0, 40, (1, 8), device=DEVICE)
    assert model(tokens).dtype == torch.bfloat16
    assert fuse_projections(model, packed_attention=False) is model  # already fused: left alone


def test_packed_attention_is_only_chosen_for_flash_triton_with_rope():
    for impl in ("sdpa", "flash_pytorch"):
        model = BasicsTransformerLM(vocab_size=40, context_length=16, d_model=32, num_layers=1, num_heads=2,
                                    d_ff=48, attention_impl=impl)
        assert not fuse_projections(model).layers[0].attn.packed


def test_bad_packed_inputs_fail_in_one_line():
    rope = RotaryEmbedding(16, 8, device=DEVICE)
    cos, sin = _tables(rope, 8)
    qkv = torch.randn(2, 8, 48, device=DEVICE)
    cases = [
        (torch.randn(2, 8, 3, 16, device=DEVICE), 2, cos, sin, "must be \\(batch, seq, 3·heads·d\\)"),
        (qkv, 5, cos, sin, "not 3 × num_heads \\(5\\)"),
        (torch.randn(2, 8, 18, device=DEVICE), 2, cos, sin, "head dimension 3 is not supported"),
        (qkv.to(torch.float64), 2, cos, sin, "float16, bfloat16 or float32"),
        (qkv, 2, cos.double(), sin, "cos must be float32"),
        (qkv, 2, cos[:4], sin, "cos must be \\(seq, d/2\\)"),
        (torch.randn(2, 48, 8, device=DEVICE).transpose(1, 2), 2, cos, sin, "last dimension must be contiguous"),
    ]
    for qkv_, heads, c, s, message in cases:
        with pytest.raises(ValueError, match=message):
            FlashAttentionQKVPacked.apply(qkv_, heads, c, s, True)


@pytest.mark.slow
def test_the_custom_operators_fake_implementations_match_the_kernels():
    """``torch.library.opcheck``: the shape-only implementations that ``torch.compile`` traces give the real
    outputs' shapes, strides and dtypes, and the operators survive schema and autograd registration checks."""
    from cs336_systems.attention import flash_qkvpacked as fq

    torch.manual_seed(2)
    batch, seq, heads, d = 2, 20, 2, 16
    rope = RotaryEmbedding(32, d, device=DEVICE)
    cos, sin = _tables(rope, seq)
    qkv = torch.randn(batch, seq, 3 * heads * d, device=DEVICE)
    o, lse, qk = fq._packed_forward(qkv, heads, cos, sin, True, d ** -0.5)
    do = torch.randn_like(o)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(fq.flash_attention_qkvpacked_forward, (qkv, heads, cos, sin, True, d ** -0.5),
                          test_utils=tests)
    torch.library.opcheck(fq.flash_attention_qkvpacked_backward, (do, qkv, qk, o, lse, cos, sin, True, d ** -0.5),
                          test_utils=tests)


@pytest.mark.slow
def test_the_packed_model_compiles_in_one_graph_and_matches_eager():
    """``torch.compile(fullgraph=True)`` over a fused model's loss and backward (Inductor on a GPU; on CPU the
    aot_eager backend, which runs Dynamo and AOTAutograd over the custom operators without a C++ compile)."""
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = fuse_projections(BasicsTransformerLM(vocab_size=40, context_length=16, d_model=32, num_layers=1,
                                                 num_heads=2, d_ff=48, attention_impl="flash_triton",
                                                 device=DEVICE))
    x, y = torch.randint(0, 40, (2, 16), device=DEVICE), torch.randint(0, 40, (2, 16), device=DEVICE)

    def loss_and_grads():
        model.zero_grad()
        loss = cross_entropy(model(x), y)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    want_loss, want_grads = loss_and_grads()
    step = torch.compile(lambda: cross_entropy(model(x), y), backend=backend, fullgraph=True)
    model.zero_grad()
    loss = step()
    loss.backward()
    torch.testing.assert_close(loss.detach(), want_loss, atol=1e-5, rtol=1e-5)
    for p, want in zip(model.parameters(), want_grads):
        torch.testing.assert_close(p.grad, want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("fused, packed", [(True, True), (True, False), (False, False)])
def test_compiled_steps_hand_do_to_the_backward_token_major_without_a_copy(monkeypatch, fused, packed):
    """Inside a compiled step the attention's dO is the output projection's gradient, token-major. Traced
    through an ``autograd.Function``, Dynamo assumed it contiguous (head-major) and the graph copied it; the
    operators' registered backward receives it as the step made it. Checked for the packed path, the fused
    split path and the plain model, against eager gradients."""
    from cs336_systems.attention import flash_qkvpacked as fq
    from cs336_systems.attention import flash_triton as ft

    seen = []
    for module, name in ((fq, "_packed_backward"), (ft, "_backward")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda do, *a, _f=original, **k: seen.append(do.stride()) or _f(do, *a, **k))
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = BasicsTransformerLM(vocab_size=40, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=48,
                                attention_impl="flash_triton", device=DEVICE)
    model = fuse_projections(model, packed_attention=packed) if fused else model
    x, y = torch.randint(0, 40, (2, 16), device=DEVICE), torch.randint(0, 40, (2, 16), device=DEVICE)
    cross_entropy(model(x), y).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    seen.clear()
    cross_entropy(torch.compile(model, backend=backend)(x), y).backward()
    heads, seq, d = 2, 16, 16
    assert seen == [(seq * heads * d, d, heads * d, 1)]  # (batch, heads, seq, d) over token-major memory
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, w, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(DEVICE != "cuda", reason="16-bit kernels need a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d, heads", [(64, 12), (80, 4), (128, 2)])
def test_packed_attention_in_16_bit_matches_the_split_path_on_a_gpu(dtype, d, heads):
    """The model's dtypes and head dims (64: small to xl, 80: 2.7B, 128): the rotation is the same float32
    arithmetic as RotaryEmbedding's, so the two paths differ only by the attention kernels' rounding order."""
    torch.manual_seed(3)
    batch, seq = 2, 300
    rope = RotaryEmbedding(512, d, device=DEVICE)
    qkv = torch.randn(batch, seq, 3 * heads * d, device=DEVICE, dtype=dtype, requires_grad=True)
    grad = torch.randn(batch, heads, seq, d, device=DEVICE, dtype=dtype)
    expected = _split_path(qkv, heads, rope, None, True)
    (expected_grad,) = torch.autograd.grad(expected, qkv, grad)
    got = flash_attention_qkvpacked(qkv, heads, *_tables(rope, seq), True)
    (got_grad,) = torch.autograd.grad(got, qkv, grad)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_grad, expected_grad, atol=5e-2, rtol=5e-2)
