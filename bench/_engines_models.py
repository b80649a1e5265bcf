"""bench/engines.py's models, in plain torch (no torchvision) with random weights: ResNet-50, a BERT-like
encoder, an MLP and a model whose export fails (``workload(name)``: the model and its input)."""
from __future__ import annotations

import torch
from torch import nn


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(blocks):
                layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * 4
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


class ExportFails(nn.Module):
    """An MLP whose branch depends on the input's values: a trace bakes one branch in."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
        self.b = nn.Linear(1024, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if x.mean() > -1.0 else self.b(x)


def workload(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name.startswith("resnet50"):
        batch = int(name.rsplit("-b", 1)[1])
        model = ResNet50()
        for module in model.modules():   # non-trivial BN statistics, as a trained model has
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 1.5)
        return model.eval(), torch.randn(batch, 3, 224, 224)
    if name in ("bert", "bert2"):
        layer = nn.TransformerEncoderLayer(768, 12, 3072, dropout=0.1, activation="gelu", batch_first=True)
        layers = 2 if name == "bert2" else 4
        return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval(), torch.randn(4, 128, 768)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1024))
        return model.eval(), torch.randn(64, 1024)
    if name == "export-fails":
        return ExportFails().eval(), torch.randn(64, 1024)
    raise SystemExit(f"--models: unknown model {name!r}")
