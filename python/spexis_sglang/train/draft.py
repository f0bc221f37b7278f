"""train-draft: fit the draft head to the base model's own greedy next tokens.

The head's attention needs the sequence context, so it trains on whole sequences (prompt and
answer, padded into token-budget batches), never on isolated rows. Loss per position:
``(1 - kl_weight) * CE(base greedy token) + kl_weight * KL(base distribution || head)``; the
base distribution is recomputed from its stored final hidden state and LM head (distillation
without storing logits). Answer rows weigh 1, prompt rows ``prompt_loss_weight``; the last
position (after EOS) is not trained. The LM head is frozen. The head starts as the exit layer's
"logit lens" (see :meth:`DraftHead.reset_parameters`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from spexis_sglang.models.draft_head import DraftHead, DraftHeadConfig, greedy_with_confidence
from spexis_sglang.train.collect import Collected

logger = logging.getLogger(__name__)


@dataclass
class DraftTrainConfig:
    exit_layer: int
    num_layers: int = 1
    epochs: int = 3
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 20
    batch_tokens: int = 4096
    max_seq_len: int = 2048
    prompt_loss_weight: float = 0.1
    kl_weight: float = 0.5
    loss_chunk: int = 1024
    seed: int = 0
    device: str = "cpu"
    # "bfloat16": autocast the forward and loss (weights and optimizer stay fp32); the
    # default on a GPU, where it about doubles the tokens/s of the LM-head matmuls
    dtype: str = "float32"


def _autocast(cfg: DraftTrainConfig):
    if cfg.dtype == "float32":
        return contextlib.nullcontext()
    device_type = "cuda" if str(cfg.device).startswith("cuda") else "cpu"
    return torch.autocast(device_type, dtype=getattr(torch, cfg.dtype))


def _batches(lengths: list[int], budget: int, rng: random.Random) -> list[list[int]]:
    """Group sequence indices of similar length so that ``len(batch) * max_len <= budget``."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches, cur, cur_max = [], [], 0
    for i in order:
        m = max(cur_max, lengths[i])
        if cur and m * (len(cur) + 1) > budget:
            batches.append(cur)
            cur, m = [], lengths[i]
        cur.append(i)
        cur_max = m
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def _pad_batch(
    data: Collected, idx: list[int], exit_layer: int, max_len: int, device: str, prompt_w: float
) -> dict[str, torch.Tensor]:
    """Right-padded rows of sequences ``idx``: one gather per tensor, on the tensors' device
    (the training set may live on the GPU), instead of a copy per sequence on the host."""
    h = data.tensors[f"hidden_{exit_layer}"]
    src = h.device
    lens = torch.tensor([min(data.meta[i]["length"], max_len) for i in idx], device=src)
    plen = torch.tensor([data.meta[i]["prompt_len"] for i in idx], device=src)
    full = torch.tensor([data.meta[i]["length"] for i in idx], device=src)
    starts = data.offsets[idx].to(src)
    b, t = len(idx), int(lens.max())
    pos = torch.arange(t, device=src).expand(b, t)
    mask = pos < lens[:, None]
    where = torch.where(mask, starts[:, None] + pos, torch.zeros_like(pos))
    m = mask[..., None]
    out = {
        "hidden": torch.where(m, h[where].float(), 0.0),
        "next": torch.where(mask, data.tensors["next"][where].long(), 0),
        # prompt rows get prompt_w; answer rows 1 (the last position is after EOS)
        "weight": torch.where(
            pos < torch.minimum(plen - 1, lens)[:, None],
            torch.tensor(prompt_w, device=src),
            ((pos >= (plen - 1)[:, None]) & (pos < torch.minimum(full - 1, lens)[:, None])).float(),
        ),
        "mask": mask,
        "positions": pos,
    }
    if "final" in data.tensors:
        out["final"] = torch.where(m, data.tensors["final"][where].float(), 0.0)
    return {k: v.to(device) for k, v in out.items()}


def _on_device(data: Collected, device: str) -> Collected:
    if str(device) == "cpu":
        return data
    return replace(data, tensors={k: v.to(device) for k, v in data.tensors.items()})


def _chunk_loss(
    z: torch.Tensor,
    tgt: torch.Tensor,
    w: torch.Tensor,
    fin: torch.Tensor | None,
    lm_w: torch.Tensor,
    kl_weight: float,
) -> torch.Tensor:
    logp = F.log_softmax(z @ lm_w.t(), dim=-1)
    loss = -(logp.gather(-1, tgt[:, None]).squeeze(-1)) * (1.0 - kl_weight)
    if fin is not None and kl_weight > 0:
        with torch.no_grad():
            tlogp = F.log_softmax(fin @ lm_w.t(), dim=-1)
        loss = loss + kl_weight * (tlogp.exp() * (tlogp - logp)).sum(-1)
    return (loss * w).sum()


def new_draft_head(
    base_config, final_norm_weight: torch.Tensor, num_layers: int, seed: int
) -> DraftHead:
    torch.manual_seed(seed)
    head = DraftHead(DraftHeadConfig.from_base(base_config, num_layers=num_layers))
    head.reset_parameters(final_norm_weight=final_norm_weight.detach().float().cpu())
    return head


def train_draft_head(
    head: DraftHead,
    train: Collected,
    val: Collected | None,
    lm_head_weight: torch.Tensor,
    cfg: DraftTrainConfig,
) -> tuple[DraftHead, dict]:
    """AdamW with warmup + cosine decay; keeps the epoch with the best validation acceptance."""
    device = cfg.device
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    head = head.to(device).train()
    lm_w = lm_head_weight.detach().to(device, torch.float32)
    # one copy of the (fp16) training rows on the device; batches are gathered there
    train, val = _on_device(train, device), (None if val is None else _on_device(val, device))
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    lengths = [min(m["length"], cfg.max_seq_len) for m in train.meta]
    steps_per_epoch = len(_batches(lengths, cfg.batch_tokens, random.Random(0)))
    total = max(1, steps_per_epoch * cfg.epochs)

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        prog = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    history = []
    best_state, best_acc = None, -1.0
    t0 = time.time()
    step = 0
    for epoch in range(cfg.epochs):
        head.train()
        batches = _batches(lengths, cfg.batch_tokens, rng)
        bar = tqdm(
            batches,
            desc=f"train-draft exit{cfg.exit_layer} epoch {epoch + 1}/{cfg.epochs}",
            unit="batch",
        )
        run_loss, run_w = 0.0, 0.0
        for idx in bar:
            b = _pad_batch(
                train, idx, cfg.exit_layer, cfg.max_seq_len, device, cfg.prompt_loss_weight
            )
            with _autocast(cfg):
                z, _ = head(b["hidden"], b["positions"], key_padding_mask=b["mask"])
                sel = b["weight"] > 0
                zf, tf, wf = z[sel], b["next"][sel], b["weight"][sel]
                ff = b["final"][sel] if "final" in b else None
                loss = zf.new_zeros((), dtype=torch.float32)
                for s in range(0, zf.shape[0], cfg.loss_chunk):
                    sl = slice(s, s + cfg.loss_chunk)
                    loss = loss + checkpoint(
                        _chunk_loss,
                        zf[sl],
                        tf[sl],
                        wf[sl],
                        None if ff is None else ff[sl],
                        lm_w,
                        cfg.kl_weight,
                        use_reentrant=False,
                    )
            norm = wf.sum().clamp_min(1.0)
            opt.zero_grad(set_to_none=True)
            (loss / norm).backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            run_loss += float(loss.detach())
            run_w += float(norm)
            bar.set_postfix(loss=f"{run_loss / run_w:.3f}")
        entry = {
            "epoch": epoch + 1,
            "train_loss": run_loss / max(run_w, 1e-9),
            "seconds": time.time() - t0,
        }
        if val is not None and len(val):
            acc = float(
                draft_predictions(head, val, cfg.exit_layer, lm_w, device)["accept"].float().mean()
            )
            entry["val_acceptance"] = acc
            if acc > best_acc:
                best_acc = acc
                best_state = {k: v.detach().clone() for k, v in head.state_dict().items()}
        history.append(entry)
        logger.info("exit %d epoch %d: %s", cfg.exit_layer, epoch + 1, entry)
    if best_state is not None:
        head.load_state_dict(best_state)
    head.eval()
    return head, {
        "history": history,
        "best_val_acceptance": best_acc,
        "steps": step,
        "seconds": time.time() - t0,
    }


@torch.no_grad()
def draft_predictions(
    head: DraftHead,
    data: Collected,
    exit_layer: int,
    lm_head_weight: torch.Tensor,
    device: str = "cpu",
    batch_tokens: int = 8192,
) -> dict[str, torch.Tensor]:
    """Draft token and confidence on every answer row, and whether the server would accept it.

    Row ``p`` (input token at position ``p``, ``prompt_len - 1 <= p < length - 1``) drafts the
    token at ``p + 1``; it is accepted iff it equals the base's greedy token there (``next[p]``),
    both given the same verified prefix. Returns flat tensors over all rows, plus ``seq`` (the
    sequence index) and ``pos``.
    """
    head = head.to(device).eval()
    lm_w = lm_head_weight.to(device, torch.float32)
    out: dict[str, list[torch.Tensor]] = {
        k: [] for k in ("draft", "confidence", "target", "seq", "pos")
    }
    lengths = [m["length"] for m in data.meta]
    for idx in _batches(lengths, batch_tokens, random.Random(0)):
        idx = sorted(idx)
        b = _pad_batch(data, idx, exit_layer, 1 << 30, device, 0.0)
        z, _ = head(b["hidden"], b["positions"], key_padding_mask=b["mask"])
        for j, i in enumerate(idx):
            m = data.meta[i]
            rows = torch.arange(m["prompt_len"] - 1, m["length"] - 1)
            tok, conf = greedy_with_confidence(z[j, rows.to(device)] @ lm_w.t())
            out["draft"].append(tok.cpu())
            out["confidence"].append(conf.cpu())
            out["target"].append(b["next"][j, rows.to(device)].cpu())
            out["seq"].append(torch.full_like(rows, i))
            out["pos"].append(rows)
    res = {k: torch.cat(v) if v else torch.zeros(0) for k, v in out.items()}
    order = torch.argsort(res["seq"] * (1 << 20) + res["pos"]) if len(res["seq"]) else None
    if order is not None:
        res = {k: v[order] for k, v in res.items()}
    res["accept"] = res["draft"] == res["target"]
    return res
