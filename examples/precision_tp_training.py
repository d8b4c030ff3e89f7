"""Train a small tensor-parallel MLP with a bf16 wire / fp32 accumulation, next to fp32.

The model is Megatron's MLP block on ``world`` ranks: ``copy_to_region`` (identity
forward, all_reduce of the gradient in backward), a column-parallel ``Linear``, GELU, a
row-parallel ``Linear``, ``reduce_from_region`` (all_reduce forward). The same weights
and data train twice: once exact (fp32 on the wire), once with
``precision=dc.Precision("bf16")`` on both mappings — the activations' all_reduce and the
gradients' all_reduce travel in bf16 and are summed in fp32, rounded once. The loss
curves are overlaid (``--plot out.png``) and printed.

Run: ``python examples/precision_tp_training.py [--world 2] [--steps 60] [--plot losses.png]``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import diffcomm as dc
from diffcomm import parallel as P


def train(
    steps: int, precision: dc.Precision | None, d: int = 32, hidden: int = 64, lr: float = 0.05
) -> list[float]:
    """One rank's training loop; returns the loss per step (equal on every rank)."""
    r, w = dc.get_rank(), dc.get_world_size()
    if hidden % w:  # a shard of hidden // w columns each would drop the last hidden % w units
        raise ValueError(f"train(): `hidden` must be divisible by the number of ranks {w}, got {hidden}")
    gen = torch.Generator().manual_seed(0)  # the same full weights and data on every rank
    w1 = torch.randn(d, hidden, generator=gen) / d**0.5
    w2 = torch.randn(hidden, d, generator=gen) / hidden**0.5
    shard = hidden // w
    w1_r = w1[:, r * shard : (r + 1) * shard].clone().requires_grad_(True)  # column parallel
    w2_r = w2[r * shard : (r + 1) * shard].clone().requires_grad_(True)  # row parallel
    teacher = torch.randn(d, d, generator=gen) / d**0.5
    opt = torch.optim.SGD([w1_r, w2_r], lr=lr)
    kw: dict[str, Any] = {} if precision is None else {"precision": precision}
    losses = []
    for _ in range(steps):
        x = torch.randn(64, d, generator=gen)
        target = torch.tanh(x @ teacher)
        h = torch.nn.functional.gelu(P.copy_to_region(x, **kw) @ w1_r)
        y = P.reduce_from_region(h @ w2_r, **kw)
        loss = torch.nn.functional.mse_loss(y, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def run(world: int, steps: int) -> dict[str, list[float]]:
    """Both runs on one ``LocalWorld``: ``{"fp32": losses, "bf16 wire / fp32 acc": losses}``."""
    with dc.LocalWorld(world) as ranks:
        exact = ranks.run(train, steps, None)[0]
        low = ranks.run(train, steps, dc.Precision("bf16"))[0]
    return {"fp32": exact, "bf16 wire / fp32 acc": low}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, default=2, help="ranks; must divide the hidden size 64")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--plot", default=None, help="write the overlaid loss curves to this PNG")
    a = parser.parse_args()
    curves = run(a.world, a.steps)
    for name, losses in curves.items():
        print(f"{name:<22} first {losses[0]:.5f}  last {losses[-1]:.5f}")
    gap = max(abs(u - v) / v for u, v in zip(curves["bf16 wire / fp32 acc"], curves["fp32"]))
    print(f"largest relative gap between the curves: {gap:.2e}")
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, losses in curves.items():
            ax.plot(losses, label=name, linestyle="-" if name == "fp32" else "--")
        ax.set_xlabel("step")
        ax.set_ylabel("MSE loss")
        ax.set_title(f"TP MLP on {a.world} ranks: fp32 vs bf16 wire")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
        print(f"wrote {a.plot}")


if __name__ == "__main__":
    main()
