"""cs336_basics against its PyTorch counterparts, on CPU."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cs336_basics import model as M
from cs336_basics import nn_utils
from cs336_basics.data import get_batch
from cs336_basics.optimizer import AdamW, get_cosine_lr
from cs336_basics.serialization import load_checkpoint, save_checkpoint


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def test_linear_matches_functional_and_init_statistics() -> None:
    lin = M.Linear(256, 512)
    assert lin.weight.shape == (512, 256)
    x = torch.randn(3, 7, 256)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight))
    std = math.sqrt(2 / (256 + 512))
    assert lin.weight.abs().max() <= 3 * std + 1e-6
    assert abs(lin.weight.std().item() - std) / std < 0.15  # truncation lowers the std by ~12%


def test_embedding_matches_functional() -> None:
    emb = M.Embedding(100, 16)
    ids = torch.randint(0, 100, (4, 9))
    torch.testing.assert_close(emb(ids), F.embedding(ids, emb.weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_torch_and_keeps_dtype(dtype: torch.dtype) -> None:
    ours = M.RMSNorm(32, eps=1e-5)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
    ref = torch.nn.RMSNorm(32, eps=1e-5)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 5, 32)
    y = ours(x.to(dtype))
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), ref(x), atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)


def test_rope_rotates_pairs_and_preserves_norm() -> None:
    rope = M.RotaryEmbedding(context_length=16, dim=8, theta=10000.0)
    x = torch.randn(2, 16, 8)
    pos = torch.arange(16)
    y = rope(x, pos)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    # Reference: complex multiplication of interleaved pairs by e^{i θ_k p}.
    freqs = 10000.0 ** (-torch.arange(0, 8, 2).float() / 8)
    angle = pos[:, None].float() * freqs[None]
    xc = torch.view_as_complex(x.reshape(2, 16, 4, 2).contiguous())
    ref = torch.view_as_real(xc * torch.polar(torch.ones_like(angle), angle)).reshape(2, 16, 8)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    # Relative-position property: <R_m q, R_n k> depends on m - n only.
    q, k = torch.randn(8), torch.randn(8)
    dot = lambda m, n: (rope(q[None], torch.tensor([m])) * rope(k[None], torch.tensor([n]))).sum()  # noqa: E731
    torch.testing.assert_close(dot(5, 3), dot(9, 7), atol=1e-5, rtol=1e-5)


def test_rope_default_positions_and_launch_count() -> None:
    """``pos_ids=None`` means 0..seq-1 (a slice of the tables), and one rotation stays a handful of
    kernels: the model runs two per block, and a launch-bound step (bf16 autocast, small batch) pays
    host time for every kernel. This form takes 12 forward and backward; the slice/multiply/stack form
    took 21."""
    from torch.utils._python_dispatch import TorchDispatchMode

    rope = M.RotaryEmbedding(context_length=16, dim=8)
    x = torch.randn(2, 3, 12, 8, dtype=torch.bfloat16, requires_grad=True)
    torch.testing.assert_close(rope(x), rope(x, torch.arange(12)), atol=0, rtol=0)

    views = {"view", "_unsafe_view", "t", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze",
             "permute", "as_strided", "alias", "detach", "split", "unbind"}

    class CountKernels(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            name = func.__name__.split(".")[0]
            if name not in views:
                self.ops.append(name)
            return func(*args, **(kwargs or {}))

    grad = torch.randn(2, 3, 12, 8, dtype=torch.bfloat16)
    with CountKernels() as counter:
        rope(x).backward(grad)
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    assert len(counter.ops) <= 14, counter.ops


def test_swiglu_matches_formula() -> None:
    ffn = M.SwiGLU(16, 40)
    x = torch.randn(3, 16)
    expected = F.linear(F.silu(F.linear(x, ffn.w1.weight)) * F.linear(x, ffn.w3.weight), ffn.w2.weight)
    torch.testing.assert_close(ffn(x), expected)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_matches_torch(causal: bool) -> None:
    q, k, v = torch.randn(2, 3, 12, 8), torch.randn(2, 3, 12, 8), torch.randn(2, 3, 12, 8)
    mask = torch.ones(12, 12, dtype=torch.bool).tril() if causal else None
    ours = M.scaled_dot_product_attention(q, k, v, mask)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, is_causal=causal), atol=1e-5, rtol=1e-5)


def test_attention_registry() -> None:
    assert {"naive", "sdpa"} <= set(M.available_attention_impls())
    with pytest.raises(ValueError, match="unknown attention implementation"):
        M.get_attention("does-not-exist")
    with pytest.raises(ValueError, match="already registered"):
        M.register_attention("naive", lambda q, k, v, c: q)


def _tiny_lm(**kw) -> M.BasicsTransformerLM:
    return M.BasicsTransformerLM(vocab_size=50, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=64, **kw)


def test_lm_forward_backward_and_attention_impls_agree() -> None:
    lm = _tiny_lm()
    ids = torch.randint(0, 50, (3, 16))
    logits = lm(ids)
    assert logits.shape == (3, 16, 50)
    loss = nn_utils.cross_entropy(logits, torch.randint(0, 50, (3, 16)))
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in lm.parameters())
    lm.set_attention_impl("sdpa")
    torch.testing.assert_close(lm(ids), logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        lm(torch.randint(0, 50, (1, 17)))


def test_lm_is_causal() -> None:
    lm = _tiny_lm()
    ids = torch.randint(0, 50, (1, 16))
    changed = ids.clone()
    changed[0, 10] = (ids[0, 10] + 1) % 50
    a, b = lm(ids), lm(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_softmax_log_softmax_cross_entropy_match_torch() -> None:
    x = torch.randn(4, 7, 11) * 30  # large logits: stability matters
    torch.testing.assert_close(nn_utils.softmax(x, -1), F.softmax(x, -1))
    torch.testing.assert_close(nn_utils.log_softmax(x, -1), F.log_softmax(x, -1))
    t = torch.randint(0, 11, (4, 7))
    torch.testing.assert_close(nn_utils.cross_entropy(x, t), F.cross_entropy(x.reshape(-1, 11), t.reshape(-1)))
    with pytest.raises(ValueError):
        nn_utils.cross_entropy(x, t[:, :3])


def test_clip_gradient_matches_torch() -> None:
    a = [torch.nn.Parameter(torch.randn(5, 5)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for pa, pb in zip(a, b):
        pa.grad = torch.randn_like(pa) * 10
        pb.grad = pa.grad.clone()
    nn_utils.clip_gradient(a, 1.0)
    torch.nn.utils.clip_grad_norm_(b, 1.0)
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-6, rtol=1e-4)


def test_adamw_matches_torch_over_several_steps() -> None:
    lm_a = _tiny_lm()
    lm_b = _tiny_lm()
    lm_b.load_state_dict(lm_a.state_dict())
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt_a, opt_b = AdamW(lm_a.parameters(), **kw), torch.optim.AdamW(lm_b.parameters(), **kw)
    for _ in range(5):
        ids, tgt = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))
        for lm, opt in ((lm_a, opt_a), (lm_b, opt_b)):
            opt.zero_grad()
            nn_utils.cross_entropy(lm(ids), tgt).backward()
            opt.step()
    for pa, pb in zip(lm_a.parameters(), lm_b.parameters()):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError):
        AdamW(lm_a.parameters(), lr=-1)


def test_cosine_schedule() -> None:
    kw = dict(max_learning_rate=1.0, min_learning_rate=0.1, warmup_iters=10, cosine_cycle_iters=110)
    assert get_cosine_lr(0, **kw) == 0
    assert get_cosine_lr(5, **kw) == pytest.approx(0.5)
    assert get_cosine_lr(10, **kw) == pytest.approx(1.0)
    assert get_cosine_lr(60, **kw) == pytest.approx(0.55)
    assert get_cosine_lr(110, **kw) == pytest.approx(0.1)
    assert get_cosine_lr(500, **kw) == pytest.approx(0.1)


def test_get_batch_shapes_and_shift() -> None:
    data = np.arange(100)
    x, y = get_batch(data, batch_size=8, context_length=12, device="cpu")
    assert x.shape == y.shape == (8, 12) and x.dtype == torch.long
    torch.testing.assert_close(y, x + 1)
    assert int(x.max()) < 100
    with pytest.raises(ValueError):
        get_batch(data, 2, 100, "cpu")


def test_checkpoint_roundtrip_resumes_identically() -> None:
    lm = _tiny_lm()
    opt = AdamW(lm.parameters(), lr=1e-2)
    ids, tgt = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))

    def step(model, optim):
        optim.zero_grad()
        nn_utils.cross_entropy(model(ids), tgt).backward()
        optim.step()

    step(lm, opt)
    buf = io.BytesIO()
    save_checkpoint(lm, opt, iteration=7, out=buf)
    buf.seek(0)
    lm2 = _tiny_lm()
    opt2 = AdamW(lm2.parameters(), lr=1e-2)
    assert load_checkpoint(buf, lm2, opt2) == 7
    step(lm, opt)
    step(lm2, opt2)
    for pa, pb in zip(lm.parameters(), lm2.parameters()):
        torch.testing.assert_close(pa, pb, atol=0, rtol=0)
