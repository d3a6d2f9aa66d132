#!/usr/bin/env python3
"""PyTorch's side of `train-bench`: the same models, optimizers, global batch and
thread count as ckpt's benchmark, images per second over the timed steps.

    python3 scripts/torch_train_bench.py MODEL STEPS THREADS [DEVICE [BATCH]]

MODEL is `mlp` (64-512-256-10 on 8x8 single-channel images, AdamW), `resnet`
(ResNet-20 on CIFAR shapes, 3x32x32, SGD with momentum) or `resnet50` (bottleneck
blocks 3-4-6-3 with a 3x3 stem, as ckpt builds it for 32x32 images, SGD); random data,
as in train-bench, since the content does not change the speed. The same warm-up steps
as train-bench (20 for the mlp, 2 for the ResNets) are left out. Prints one number.
DEVICE (default cpu; `cuda` for scripts/gpu_check.sh) and BATCH (default 64): PyTorch
eager on that device, synchronized before the clock stops.
"""
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class Bottleneck(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, cin = [], 64
        for s, (n, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
            for i in range(n):
                layers.append(Bottleneck(cin, width, 2 if i == 0 and s > 0 else 1))
                cin = width * 4
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.layers(F.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ResNet20(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                layers.append(Block(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        x = self.layers(F.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def main():
    model_name, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    device = torch.device(sys.argv[4] if len(sys.argv) > 4 else "cpu")
    batch = int(sys.argv[5]) if len(sys.argv) > 5 else 64
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    if model_name == "mlp":
        model = nn.Sequential(nn.Flatten(), nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                              nn.Linear(256, 10))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        shape = (batch, 1, 8, 8)
    else:
        model = ResNet50() if model_name == "resnet50" else ResNet20()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
        shape = (batch, 3, 32, 32)
    model.to(device)
    xs = [torch.rand(shape, device=device) for _ in range(4)]
    ys = [torch.randint(0, 10, (batch,), device=device) for _ in range(4)]
    model.train()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(i):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xs[i % 4]), ys[i % 4])
        loss.backward()
        opt.step()

    for i in range(20 if model_name == "mlp" else 2):  # warm-up (allocator, kernels)
        step(i)
    sync()
    t = time.perf_counter()
    for i in range(steps):
        step(i)
    sync()
    print(f"{steps * batch / (time.perf_counter() - t):.1f}")


if __name__ == "__main__":
    main()
