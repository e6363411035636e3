"""pipecomm.lab.workloads.models: shapes for digits/MNIST/CIFAR inputs, backward, determinism, sizes, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipecomm.lab.workloads import models
from pipecomm.lab.workloads.models import count_parameters, get_model, param_bytes

IMAGE_MODELS = ("mlp", "cnn", "alexnet_like", "resnet18_like")
INPUTS = {"digits": (1, 8), "mnist": (1, 28), "cifar10": (3, 32)}


def _small(name):
    """Keyword arguments that keep a model cheap on 2 CPU cores."""
    return {"resnet18_like": {"width": 8}, "alexnet_like": {"fc_width": 64}}.get(name, {})


@pytest.mark.parametrize("data_set", INPUTS)
@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_image_model_shapes_and_backward(name, data_set):
    c, s = INPUTS[data_set]
    torch.manual_seed(0)
    model = get_model(name, in_channels=c, image_size=s, num_classes=7, **_small(name))
    x = torch.randn(3, c, s, s)
    out = model(x)
    assert out.shape == (3, 7) and out.dtype == torch.float32
    loss = F.cross_entropy(out, torch.tensor([0, 3, 6]))
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum().item() for g in grads) > 0
    assert count_parameters(model) > 0 and param_bytes(model) == 4 * count_parameters(model)


@pytest.mark.parametrize("name", IMAGE_MODELS + ("char_transformer",))
def test_determinism_for_a_seed(name):
    def build(seed):
        torch.manual_seed(seed)
        return get_model(name, **_small(name))

    a, b, c = build(1), build(1), build(2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())
    # same forward output for the same input
    if name == "char_transformer":
        x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    else:
        x = torch.randn(2, *((3, 32, 32) if name == "resnet18_like" else (1, 8, 8)))
    a.eval(), b.eval()
    with torch.no_grad():
        assert torch.equal(a(x), b(x))


def test_default_parameter_counts():
    """Counts from the architectures' formulas (an oracle independent of nn.Module bookkeeping)."""
    # mlp 64-128-64-10
    assert count_parameters(get_model("mlp")) == 64 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10
    # cnn: conv 1->16, 16->32 (3x3), 8x8 -> 2x2 after two pools, fc 128->64->10
    conv = (1 * 16 * 9 + 16) + (16 * 32 * 9 + 32)
    assert count_parameters(get_model("cnn")) == conv + (32 * 4 * 64 + 64) + (64 * 10 + 10)
    # alexnet_like default: same convs, fc 128 -> 1024 -> 1024 -> 10
    fc = (128 * 1024 + 1024) + (1024 * 1024 + 1024) + (1024 * 10 + 10)
    assert count_parameters(get_model("alexnet_like")) == conv + fc
    # the standard CIFAR ResNet-18 has 11,173,962 parameters
    assert count_parameters(get_model("resnet18_like")) == 11_173_962
    # char transformer: embeddings, 2 blocks, final LayerNorm, untied head
    v, t, d, nl = 128, 64, 128, 2
    block = 2 * (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    assert (
        count_parameters(get_model("char_transformer"))
        == v * d + t * d + nl * block + 2 * d + d * v
    )


def test_alexnet_like_is_fc_heavy_and_scales_with_width():
    small = get_model("alexnet_like", fc_width=1024)
    big = get_model("alexnet_like", fc_width=2048)
    fc = sum(p.numel() for n, p in big.named_parameters() if n.startswith("classifier"))
    assert fc / count_parameters(big) > 0.99
    assert 3 * 2**20 < param_bytes(small) < 8 * 2**20  # a few MB
    assert param_bytes(big) > 3.5 * param_bytes(small) * 0.9 and param_bytes(big) > 16 * 2**20


def test_char_transformer_shapes_causality_and_backward():
    torch.manual_seed(0)
    m = get_model("char_transformer", vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32)
    x = torch.randint(0, 50, (3, 16))
    logits = m(x)
    assert logits.shape == (3, 16, 50)
    # causal: changing token t leaves logits before t unchanged
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % 50
    with torch.no_grad():
        l1, l2 = m(x), m(x2)
    torch.testing.assert_close(l1[:, :10], l2[:, :10])
    assert not torch.allclose(l1[:, 10:], l2[:, 10:])
    # shorter sequences work; backward reaches every parameter
    loss = F.cross_entropy(m(x[:, :5]).reshape(-1, 50), x[:, 1:6].reshape(-1))
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())
    assert abs(loss.item() - torch.log(torch.tensor(50.0)).item()) < 0.5  # near-uniform at init


def test_resnet_norm_options():
    for norm in ("batch", "group", "none"):
        m = get_model("resnet18_like", width=8, norm=norm)
        assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert sum(b.numel() for b in get_model("resnet18_like", width=8, norm="none").buffers()) == 0
    with pytest.raises(ValueError, match="norm"):
        get_model("resnet18_like", norm="layer")


def test_mlp_flattened_inputs():
    m = get_model("mlp", in_features=20, hidden=(5,))
    assert m(torch.randn(4, 20)).shape == (4, 10)
    with pytest.raises(ValueError, match="features"):
        m(torch.randn(4, 21))


def test_bad_arguments():
    with pytest.raises(ValueError, match="mlp"):
        get_model("vgg16")
    with pytest.raises(ValueError, match="in_channels"):
        get_model("cnn", in_channels=0)
    with pytest.raises(ValueError, match="image_size"):
        get_model("cnn", image_size=2)
    with pytest.raises(ValueError, match=r"\[N, 1, 8, 8\]"):
        get_model("cnn")(torch.randn(2, 1, 28, 28))
    with pytest.raises(ValueError, match="divisible"):
        get_model("char_transformer", n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="block_size"):
        get_model("char_transformer", block_size=8)(torch.zeros(1, 9, dtype=torch.int64))
    with pytest.raises(TypeError):
        get_model("mlp", nonsense=1)
    assert set(models.MODELS) == {"mlp", "cnn", "alexnet_like", "resnet18_like", "char_transformer"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", IMAGE_MODELS + ("char_transformer",))
def test_cuda_forward_backward(name):
    torch.manual_seed(0)
    model = get_model(name, **_small(name)).cuda()
    if name == "char_transformer":
        x = torch.randint(0, 128, (2, 16), device="cuda")
        out = model(x).float().sum()
    else:
        c, s = (3, 32) if name == "resnet18_like" else (1, 8)
        x = torch.randn(2, c, s, s, device="cuda")
        out = model(x).sum()
    out.backward()
    assert all(p.grad is not None and p.grad.is_cuda for p in model.parameters())
