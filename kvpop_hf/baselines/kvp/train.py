"""Offline KVP training on recorded traces (KVP, ICML 2026, Algorithm 1); the language model is not run.

Each step draws ``traces_per_step`` traces and for each a context length ``n`` uniformly in
``[min_context, S - min_future]``; the agent scores context tokens ``0..n-1`` of every (layer, KV head),
``scores [L, Hkv, n]``, and the future attention ``u [L, Hkv, n]`` of queries ``n..S-1`` is the label.

* ``objective="rl"``: ``K`` permutations ``sigma^k`` by Gumbel-sort, rewards ``R(sigma^k) = -C/C*``
  ``[K, L, Hkv]``, RLOO advantages ``A_k`` (optionally divided by their std over ``k`` and clamped to
  ``[-2, 2]``), loss ``-(1 / (K n)) sum_k A_k log pi(sigma^k)`` summed over heads (each head its own agent).
* ``objective="supervised"``: :func:`~kvpop_hf.baselines.kvp.supervised.supervised_loss` on the same scores.

All randomness (traces, ``n``, Gumbel noise) comes from one ``torch.Generator`` whose state is saved with the
weights and the optimiser, so a resumed run continues exactly where it stopped. On an accelerator the traces and
the agent live there and the Gumbel noise comes from a second generator on that device (saved as well); traces
and ``n`` are still drawn on the CPU, so a run draws the same traces and lengths on every device.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch

from .ranking import gumbel_sort, pl_log_prob, rloo_advantages
from .reward import future_attention, reward
from .supervised import supervised_loss


@dataclass
class KVPTrainConfig:
    objective: str = "rl"  # rl | supervised
    supervised_loss: str = "listnet"
    samples: int = 16  # K permutations per trace (RLOO group)
    traces_per_step: int = 2
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 5.0
    min_context: int = 64
    min_future: int = 16
    normalize_advantages: bool = True
    seed: int = 0


def agent_scores(scorer, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k/v ``[L, Hkv, n, D]`` -> scores ``[L, Hkv, n]`` (positions ``0..n-1``), differentiable."""
    L, H, n, _ = k.shape
    pos = torch.arange(n, device=k.device).view(1, 1, n).expand(1, H, n)
    return torch.stack([scorer.score(l, k[l, None].float(), v[l, None].float(), pos)[0] for l in range(L)])


def traces_to(traces: Sequence[dict], device: str | torch.device) -> list[dict]:
    """The traces with their tensors on ``device`` (other entries as they are)."""
    return [{key: val.to(device) if torch.is_tensor(val) else val for key, val in tr.items()} for tr in traces]


def trace_future_attention(trace: dict, n: int) -> torch.Tensor:
    """``u [L, Hkv, n]`` of a trace at context length ``n``."""
    return torch.stack([future_attention(trace["q"][l], trace["k"][l], n, trace["scale"])
                        for l in range(trace["k"].shape[0])])


def step_loss(scorer, trace: dict, n: int, cfg: KVPTrainConfig, gen: torch.Generator) -> tuple[torch.Tensor, dict]:
    """Loss of one (trace, context length) and stats (mean normalised AUC cost of the samples or the greedy order)."""
    k, v = trace["k"][:, :, :n], trace["v"][:, :, :n]
    u = trace_future_attention(trace, n)
    scores = agent_scores(scorer, k, v)
    if cfg.objective == "rl":
        perms = gumbel_sort(scores, cfg.samples, gen)  # [K, L, H, n]
        rewards = reward(u, perms)  # [K, L, H]
        adv = rloo_advantages(rewards)
        if cfg.normalize_advantages:
            adv = (adv / adv.std(0, keepdim=True).clamp_min(1e-8)).clamp(-2.0, 2.0)
        loss = -(adv * pl_log_prob(scores, perms)).mean(0).sum() / n
        return loss, {"cost": float(-rewards.mean())}
    if cfg.objective == "supervised":
        loss = supervised_loss(scores, u, cfg.supervised_loss).sum()
        greedy = torch.argsort(scores.detach(), dim=-1, descending=True)
        return loss, {"cost": float(-reward(u, greedy).mean())}
    raise ValueError(f"Unknown objective {cfg.objective!r}: use 'rl' or 'supervised'.")


class KVPTrainer:
    """Holds the scorer, optimiser, generators and step count; :meth:`step` does one update. The traces are expected
    on the scorer's device (:func:`traces_to` moves them)."""

    def __init__(self, scorer, traces: Sequence[dict], cfg: KVPTrainConfig):
        if cfg.objective not in ("rl", "supervised"):
            raise ValueError(f"Unknown objective {cfg.objective!r}: use 'rl' or 'supervised'.")
        if cfg.objective == "rl" and cfg.samples < 2:
            raise ValueError("--samples must be >= 2 for RLOO.")
        self.scorer, self.traces, self.cfg = scorer, list(traces), cfg
        self.scorer.requires_grad_(True).train()
        self.opt = torch.optim.AdamW(scorer.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        device = next(scorer.parameters()).device
        # Gumbel noise is drawn where the scores are; on the CPU from the one generator, as it always was
        self.noise = self.gen if device.type == "cpu" else torch.Generator(device).manual_seed(cfg.seed)
        self.step_count = 0

    def sample(self) -> tuple[dict, int]:
        i = int(torch.randint(len(self.traces), (1,), generator=self.gen))
        S = self.traces[i]["k"].shape[2]
        lo, hi = min(self.cfg.min_context, S - 1), max(1, S - self.cfg.min_future)
        n = int(torch.randint(lo, max(lo, hi) + 1, (1,), generator=self.gen))
        return self.traces[i], min(n, S - 1)

    def step(self) -> dict:
        self.opt.zero_grad(set_to_none=True)
        total, costs = 0.0, []
        for _ in range(self.cfg.traces_per_step):
            trace, n = self.sample()
            loss, stats = step_loss(self.scorer, trace, n, self.cfg, self.noise)
            (loss / self.cfg.traces_per_step).backward()
            total += float(loss.detach()) / self.cfg.traces_per_step
            costs.append(stats["cost"])
        if self.cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.scorer.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.step_count += 1
        return {"step": self.step_count, "loss": total, "cost": sum(costs) / len(costs)}

    # -- resumable state ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"step": self.step_count, "scorer": self.scorer.state_dict(), "optimizer": self.opt.state_dict(),
                 "generator": self.gen.get_state(), "config": asdict(self.cfg)}
        if self.noise is not self.gen:
            state["noise_generator"] = self.noise.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.scorer.load_state_dict(state["scorer"])
        self.opt.load_state_dict(state["optimizer"])
        self.gen.set_state(state["generator"])
        if self.noise is not self.gen and "noise_generator" in state:
            self.noise.set_state(state["noise_generator"])
        self.step_count = int(state["step"])

    def save(self, path: str | Path) -> None:
        tmp = Path(str(path) + ".tmp")
        torch.save(self.state_dict(), tmp)
        tmp.replace(path)
