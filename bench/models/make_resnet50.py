"""A ResNet-50-shaped CNN (bottleneck blocks 3-4-6-3, widths 64..2048, 1000 classes; 25.6 M
parameters) written out in torch with random weights, no torchvision, exported by torch.onnx
(TorchScript, opset 17, eval mode: batch norms fold into the convs) at 1x3x224x224.

    python bench/models/make_resnet50.py OUT.onnx
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn


def conv_bn(cin: int, cout: int, k: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout))


class Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = mid * 4
        self.body = nn.Sequential(
            conv_bn(cin, mid, 1), nn.ReLU(), conv_bn(mid, mid, 3, stride), nn.ReLU(),
            conv_bn(mid, cout, 1),
        )  # fmt: skip
        self.skip = conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


class ResNet50(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [conv_bn(3, 64, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
        cin = 64
        for mid, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for b in range(blocks):
                layers.append(Bottleneck(cin, mid, stride if b == 0 else 1))
                cin = mid * 4
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(2048, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))


def main() -> None:
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    model = ResNet50().eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):  # statistics other than the identity
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(model, (torch.randn(1, 3, 224, 224),), str(out), input_names=["pixel_values"],
                      output_names=["logits"], opset_version=17, dynamo=False)  # fmt: skip
    print(out, sum(p.numel() for p in model.parameters()), "parameters")


if __name__ == "__main__":
    main()
