"""Models for the training experiments, sized by constructor arguments to fit either profile.

No paper equation; each model stands in for a workload of the papers:

* ``"mlp"`` and ``"cnn"`` - small classifiers for the convergence experiments (BSP-SGD of the LP
  paper, Pipe-SGD's MNIST/CIFAR runs) on 8x8 digits, MNIST or CIFAR-10.
* ``"alexnet_like"`` - a couple of small convolutions followed by large fully connected layers,
  so that, as in AlexNet (Daily et al.'s layer-wise/delayed GD experiments), most parameters and
  therefore most communication sit in the last layers while compute stays small. ``fc_width``
  sets the size: about 5 MB of float32 parameters at the default 1024, tens of MB at 2048-4096.
* ``"resnet18_like"`` - ResNet-18 with BasicBlocks in the CIFAR form (3x3 stem, no max-pool),
  written here without torchvision, for the gpu profile (the DAdam paper's ResNet workload).
* ``"char_transformer"`` - a tiny GPT (token + position embeddings, pre-LayerNorm blocks of
  causal self-attention and an MLP) for the character-level text of :mod:`pipecomm.lab.workloads.data`, the
  stand-in for the DAdam paper's Transformer and GPT-2 runs.

Image models take ``in_channels`` and ``image_size`` (1 and 8 for digits, 1 and 28 for MNIST, 3
and 32 for CIFAR-10) and ``num_classes``; inputs are ``[N, C, H, W]`` and outputs logits
``[N, num_classes]``. Initialisation draws only from torch's global generator, so a model is
determined by ``torch.manual_seed`` before :func:`get_model`.

Example::

    >>> torch.manual_seed(0)            # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> model = get_model("alexnet_like", in_channels=1, image_size=8, fc_width=2048)
    >>> print(count_parameters(model), round(param_bytes(model) / 2**20, 1), "MiB")
    4485834 17.1 MiB
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MODELS",
    "MLP",
    "AlexNetLike",
    "BasicBlock",
    "CharTransformer",
    "ResNet18Like",
    "SmallCNN",
    "count_parameters",
    "get_model",
    "param_bytes",
]


def _check_image_args(
    in_channels: int, image_size: int, num_classes: int, min_size: int = 1
) -> None:
    for arg, v in (
        ("in_channels", in_channels),
        ("image_size", image_size),
        ("num_classes", num_classes),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{arg} must be a positive int, got {v!r}")
    if image_size < min_size:
        raise ValueError(f"image_size must be >= {min_size} for this model, got {image_size}")


def _check_input(x: torch.Tensor, in_channels: int, image_size: int) -> None:
    if (
        x.dim() != 4
        or x.shape[1] != in_channels
        or x.shape[2] != image_size
        or x.shape[3] != image_size
    ):
        raise ValueError(
            f"expected input [N, {in_channels}, {image_size}, {image_size}], got {tuple(x.shape)}; "
            "set in_channels/image_size to match the data set"
        )


class MLP(nn.Module):
    """Fully connected classifier on flattened inputs: Linear-ReLU per hidden size, then Linear.

    Example::

        >>> MLP(in_channels=1, image_size=8, hidden=(128, 64))(torch.randn(4, 1, 8, 8)).shape
        torch.Size([4, 10])
    """

    def __init__(
        self,
        in_channels: int = 1,
        image_size: int = 8,
        num_classes: int = 10,
        hidden: Sequence[int] = (128, 64),
        in_features: int | None = None,
    ) -> None:
        super().__init__()
        _check_image_args(in_channels, image_size, num_classes)
        self.in_features = in_features if in_features is not None else in_channels * image_size**2
        widths = [self.in_features, *hidden]
        layers: list[nn.Module] = []
        for a, b in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], -1)
        if x.shape[1] != self.in_features:
            raise ValueError(f"expected {self.in_features} features per sample, got {x.shape[1]}")
        return self.net(x)


class SmallCNN(nn.Module):
    """Two conv3x3-ReLU-maxpool2 stages, then Linear-ReLU-Linear.

    Example::

        >>> SmallCNN(in_channels=3, image_size=32)(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self,
        in_channels: int = 1,
        image_size: int = 8,
        num_classes: int = 10,
        channels: Sequence[int] = (16, 32),
        hidden: int = 64,
    ) -> None:
        super().__init__()
        _check_image_args(in_channels, image_size, num_classes, min_size=2 ** len(channels))
        self.in_channels, self.image_size = in_channels, image_size
        layers: list[nn.Module] = []
        c, s = in_channels, image_size
        for out in channels:
            layers += [nn.Conv2d(c, out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
            c, s = out, s // 2
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(c * s * s, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.in_channels, self.image_size)
        return self.classifier(self.features(x))


class AlexNetLike(nn.Module):
    """Communication-bound classifier: two small convolutions, then ``fc_layers`` wide FC layers.

    Like AlexNet's fc6/fc7, the fully connected layers (``fc_width`` units each, optional dropout)
    hold almost all parameters, while the convolutions do most of the (small) compute. Parameters
    ~ ``fc_width * (conv_channels[-1] * (image_size // 4)**2 + fc_width * (fc_layers - 1))``.

    Example::

        >>> m = AlexNetLike(in_channels=1, image_size=8, fc_width=2048)
        >>> count_parameters(m)                                          # about 4.5M parameters
        4485834
    """

    def __init__(
        self,
        in_channels: int = 1,
        image_size: int = 8,
        num_classes: int = 10,
        conv_channels: Sequence[int] = (16, 32),
        fc_width: int = 1024,
        fc_layers: int = 2,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        _check_image_args(in_channels, image_size, num_classes, min_size=2 ** len(conv_channels))
        if fc_layers < 1 or fc_width < 1:
            raise ValueError(f"fc_layers and fc_width must be >= 1, got {fc_layers}, {fc_width}")
        self.in_channels, self.image_size = in_channels, image_size
        layers: list[nn.Module] = []
        c, s = in_channels, image_size
        for out in conv_channels:
            layers += [nn.Conv2d(c, out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
            c, s = out, s // 2
        self.features = nn.Sequential(*layers)
        fc: list[nn.Module] = [nn.Flatten()]
        width = c * s * s
        for _ in range(fc_layers):
            fc += [nn.Linear(width, fc_width), nn.ReLU()]
            if dropout > 0:
                fc.append(nn.Dropout(dropout))
            width = fc_width
        fc.append(nn.Linear(width, num_classes))
        self.classifier = nn.Sequential(*fc)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.in_channels, self.image_size)
        return self.classifier(self.features(x))


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        return nn.GroupNorm(min(32, channels), channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"norm must be 'batch', 'group' or 'none', got {kind!r}")


class BasicBlock(nn.Module):
    """ResNet BasicBlock: two conv3x3-norm, ReLU, with an identity or 1x1-conv shortcut.

    Example::

        >>> BasicBlock(64, 128, stride=2)(torch.randn(1, 64, 32, 32)).shape
        torch.Size([1, 128, 16, 16])
    """

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1, norm: str = "batch") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _norm(norm, planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = _norm(norm, planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), _norm(norm, planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18Like(nn.Module):
    """ResNet-18 for small images: 3x3 stem, stages of 2 BasicBlocks at widths w, 2w, 4w, 8w.

    ``width=64`` is the standard CIFAR ResNet-18 (11.2M parameters); ``norm`` picks BatchNorm
    (default), GroupNorm or none. Global average pooling makes any ``image_size`` >= 1 work.

    Example::

        >>> ResNet18Like(in_channels=3, image_size=32)(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self,
        in_channels: int = 3,
        image_size: int = 32,
        num_classes: int = 10,
        width: int = 64,
        norm: str = "batch",
    ) -> None:
        super().__init__()
        _check_image_args(in_channels, image_size, num_classes)
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.in_channels, self.image_size = in_channels, image_size
        self.conv1 = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = _norm(norm, width)
        planes, layers = width, []
        for i, mult in enumerate((1, 2, 4, 8)):
            out = width * mult
            stride = 1 if i == 0 else 2
            layers.append(
                nn.Sequential(BasicBlock(planes, out, stride, norm), BasicBlock(out, out, 1, norm))
            )
            planes = out
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(planes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.in_channels, self.image_size)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


class _CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = _CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    """Tiny GPT for character-level language modelling.

    Input int64 ids ``[N, T]`` with ``T <= block_size``; output logits ``[N, T, vocab_size]``.
    Token and learned position embeddings, ``n_layer`` pre-LayerNorm blocks (causal multi-head
    self-attention, GELU MLP of width 4 * n_embd), final LayerNorm and an untied output layer
    (no shared parameters, so every parameter is communicated exactly once).

    Example::

        >>> m = CharTransformer(vocab_size=103, block_size=64)
        >>> logits = m(torch.randint(0, 103, (8, 64)))
        >>> logits.shape
        torch.Size([8, 64, 103])
        >>> targets = torch.randint(0, 103, (8, 64))
        >>> loss = F.cross_entropy(logits.reshape(-1, 103), targets.reshape(-1))
    """

    def __init__(
        self,
        vocab_size: int = 128,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        for arg, v in (("vocab_size", vocab_size), ("block_size", block_size), ("n_layer", n_layer),
                       ("n_head", n_head), ("n_embd", n_embd)):  # fmt: skip
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{arg} must be a positive int, got {v!r}")
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        self.vocab_size, self.block_size = vocab_size, block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[_Block(n_embd, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"expected integer ids [N, T], got {idx.dtype} {tuple(idx.shape)}")
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos)[None])
        return self.head(self.ln_f(self.blocks(x)))


MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": MLP,
    "cnn": SmallCNN,
    "alexnet_like": AlexNetLike,
    "resnet18_like": ResNet18Like,
    "char_transformer": CharTransformer,
}


def get_model(name: str, **kw) -> nn.Module:
    """Build the model called ``name`` with constructor keywords ``kw``.

    Names: "mlp", "cnn", "alexnet_like", "resnet18_like", "char_transformer". Call
    ``torch.manual_seed(seed)`` first for a reproducible initialisation.

    Example::

        >>> from pipecomm.lab.workloads.corpus import CharCorpus
        >>> corpus = CharCorpus("to be or not to be")
        >>> _ = torch.manual_seed(0)
        >>> model = get_model("cnn", in_channels=1, image_size=28)                  # for MNIST
        >>> lm = get_model("char_transformer", vocab_size=corpus.vocab_size, n_layer=4)
        >>> type(model).__name__, type(lm).__name__
        ('SmallCNN', 'CharTransformer')
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {tuple(MODELS)}")
    return MODELS[name](**kw)


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameter elements (shared parameters counted once).

    Example::

        >>> count_parameters(get_model("resnet18_like"))
        11173962
    """
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def param_bytes(model: nn.Module) -> int:
    """Bytes of all parameters in their dtypes (what one full gradient allreduce moves per rank).

    Example::

        >>> round(param_bytes(get_model("alexnet_like", fc_width=2048)) / 2**20, 1)   # MiB
        17.1
    """
    return sum(p.numel() * p.element_size() for p in model.parameters())
