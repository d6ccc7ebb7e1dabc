"""A ResNet-18-style CNN for small images, through every strategy that can take it:

    ./launch.sh compare --model examples/resnet.py:resnet18 --input-shape 3,16,16 --classes 10 --batch-size 128

ResNet-18's shape (He et al. 2016): a stem, four stages of two basic blocks each (two 3x3 convolutions and
a shortcut; the first block of stages 2-4 halves the image and doubles the channels), global pooling
and one linear layer. Two changes make it a fair subject for a comparison on a laptop:

- Width 16 at the stem instead of 64 (16-32-64-128 channels): 0.70M parameters instead of 11.7M, so a
  step takes a fraction of a second on two CPU cores instead of tens of seconds.
- GroupNorm instead of BatchNorm. BatchNorm normalises by the statistics of the batch it sees; under
  data parallelism each rank sees its share, so N ranks train a different model from one device on the
  whole batch, and the oracle says so (a mismatch). DDP here converts BatchNorm to a synchronised one;
  the other strategies do not. GroupNorm normalises each sample alone, so every strategy trains the same
  model. (torchvision's resnet18 is not used: its registry build does not load against a CPU-only torch.)

The model is a sequence of children (stem, stage1..4, head) and its forward runs them in order, so the
harness finds the pipeline's cut points itself (checked by one forward), and FSDP2 shards each basic block
as its own group.
"""

from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(8, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(8, c_out)
        self.shortcut = nn.Identity() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.GroupNorm(8, c_out))

    def forward(self, x):
        y = self.norm1(self.conv1(x)).relu()
        return (self.norm2(self.conv2(y)) + self.shortcut(x)).relu()


class ResNet18(nn.Module):
    def __init__(self, width: int = 16, classes: int = 10):
        super().__init__()
        w = [width, 2 * width, 4 * width, 8 * width]
        self.stem = nn.Sequential(nn.Conv2d(3, w[0], 3, 1, 1, bias=False), nn.GroupNorm(8, w[0]), nn.ReLU())
        self.stage1 = nn.Sequential(BasicBlock(w[0], w[0], 1), BasicBlock(w[0], w[0], 1))
        self.stage2 = nn.Sequential(BasicBlock(w[0], w[1], 2), BasicBlock(w[1], w[1], 1))
        self.stage3 = nn.Sequential(BasicBlock(w[1], w[2], 2), BasicBlock(w[2], w[2], 1))
        self.stage4 = nn.Sequential(BasicBlock(w[2], w[3], 2), BasicBlock(w[3], w[3], 1))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(w[3], classes))

    def forward(self, x):  # (B, 3, H, W) -> (B, classes)
        for part in (self.stem, self.stage1, self.stage2, self.stage3, self.stage4, self.head):
            x = part(x)
        return x


def resnet18(seed: int) -> nn.Module:
    """The factory: torch is already seeded from `seed`, so nn's own initialisation is reproducible."""
    return ResNet18()
