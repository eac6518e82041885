"""Tiny two-head modules for tests, written independently of mcd_helpers.models."""

import torch
from torch import nn


class TinyTwoHead(nn.Module):
    """conv -> [norm] -> ReLU -> mean-pool -> two linear heads; forward returns (logits1,
    logits2)."""

    def __init__(
        self, norm: str = "none", in_channels: int = 1, num_classes: int = 3, dropout: float = 0.0
    ):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 4, 3, padding=1)
        self.norm = {
            "none": nn.Identity(),
            "batch": nn.BatchNorm2d(4),
            "group": nn.GroupNorm(2, 4),
            "layer": nn.GroupNorm(1, 4),
        }[norm]
        self.drop = nn.Dropout(dropout)
        self.head_a = nn.Linear(4, num_classes)
        self.head_b = nn.Linear(4, num_classes)

    def forward(self, x):
        h = self.drop(torch.relu(self.norm(self.conv(x))).mean(dim=(2, 3)))
        return self.head_a(h), self.head_b(h)


class MLPTwoHead(nn.Module):
    """Flatten -> Linear -> BatchNorm1d -> ReLU -> two heads (BatchNorm1d, not 2d)."""

    def __init__(self, d_in: int = 12, num_classes: int = 4):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(d_in, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.h1 = nn.Linear(8, num_classes)
        self.h2 = nn.Linear(8, num_classes)

    def forward(self, x):
        z = self.body(x)
        return self.h1(z), self.h2(z)
