"""train-length and calibrate: the remaining-length predictor.

Rows are the answer rows of each sequence (row ``p`` produces the token at ``p + 1``); the
target at row ``p`` is ``remaining = length - 1 - p`` tokens still to be emitted, this row's
included (``answer_len`` on the last prompt token, 1 on the row that emits EOS). Answers cut at
``max_new_tokens`` are censored: their true remaining exceeds ``remaining``, so a label
``remaining < t`` is known (false) only where ``remaining + 1 >= t``, and masked otherwise.

Masking censored rows biases the rows that are left: past ``tokens_generated > cap + 1 - t``
(cap = the collection's ``max_new_tokens``) only answers that ended remain, and every one of
them is positive. A predictor that sees the position (the ``tokens_generated`` feature, or the
hidden state to the extent it encodes it) learns that artefact. ``mask="window"`` keeps, per
threshold, only rows with ``tokens_generated + t <= cap + 1``, where the label is known whatever
the answer did (no selection); it is the mask to train and measure models with features on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from spexis_sglang.models.length_predictor import LengthPredictor
from spexis_sglang.train.collect import Collected

logger = logging.getLogger(__name__)


@dataclass
class LengthTrainConfig:
    exit_layer: int = 15
    epochs: int = 10
    lr: float = 1e-3
    weight_decay: float = 0.01
    batch_rows: int = 1024
    seed: int = 0
    device: str = "cpu"
    # positive weight per threshold: None, "balanced" (negatives / positives on the training
    # mask) or "sqrt" (its square root)
    pos_weight: str | None = None
    mask: str = "known"  # which labels train (and select the best epoch): "known" or "window"


@dataclass
class LengthRows:
    hidden: torch.Tensor  # [N, H] fp16
    remaining: torch.Tensor  # [N] int
    finished: torch.Tensor  # [N] bool
    seq: torch.Tensor  # [N] sequence index
    generated: torch.Tensor | None = None  # [N] output tokens before this row (0 first)
    prompt_len: torch.Tensor | None = None  # [N] the sequence's prompt length
    cap: torch.Tensor | None = None  # [N] the answer cap (max_new_tokens) of the collection

    def labels(
        self, thresholds: tuple[int, ...], mask: str = "known"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, known) of shape [N, K]: y = remaining < t, known = not censored.

        ``mask="window"``: known only where ``generated + t <= cap + 1`` (see the module doc).
        """
        t = torch.tensor(thresholds)[None, :]
        r = self.remaining[:, None]
        y = (r < t) & self.finished[:, None]
        known = self.finished[:, None] | (r + 1 >= t)
        if mask == "window":
            if self.generated is None or self.cap is None:
                raise ValueError("mask='window' needs rows with generated and cap")
            known = known & (self.generated[:, None] + t <= self.cap[:, None] + 1)
        elif mask != "known":
            raise ValueError(f"mask must be 'known' or 'window', got {mask!r}")
        return y, known

    def features(self) -> dict[str, torch.Tensor | None]:
        """Keyword inputs of ``LengthPredictor.forward`` besides the hidden state."""
        return {"tokens_generated": self.generated, "prompt_len": self.prompt_len}

    def subset(self, idx: torch.Tensor) -> "LengthRows":
        def take(v):
            return None if v is None else v[idx]

        return LengthRows(
            self.hidden[idx],
            self.remaining[idx],
            self.finished[idx],
            self.seq[idx],
            take(self.generated),
            take(self.prompt_len),
            take(self.cap),
        )


def length_rows(data: Collected, exit_layer: int | str) -> LengthRows:
    """Answer-position rows; ``exit_layer`` is a layer (``hidden_<L>``) or a tensor name
    (``"final"``: the ceiling variant reads the last hidden state after the final norm)."""
    hid, rem, fin, seq, gen, plen = [], [], [], [], [], []
    key = exit_layer if isinstance(exit_layer, str) else f"hidden_{exit_layer}"
    h = data.tensors[key]
    # the collection's answer cap; older data without it: the longest answer (= the cap as
    # soon as one answer was cut)
    cap = data.max_new_tokens or max((m["answer_len"] for m in data.meta), default=0)
    for i, m in enumerate(data.meta):
        s = int(data.offsets[i])
        p = torch.arange(m["prompt_len"] - 1, m["length"] - 1)
        hid.append(h[s + p])
        rem.append(m["length"] - 1 - p)
        fin.append(torch.full((len(p),), bool(m["finished"])))
        seq.append(torch.full((len(p),), i))
        gen.append(p - (m["prompt_len"] - 1))
        plen.append(torch.full((len(p),), int(m["prompt_len"])))
    if not hid:
        z = torch.zeros(0, dtype=torch.long)
        return LengthRows(
            torch.zeros(0, h.shape[-1], dtype=h.dtype),
            z,
            torch.zeros(0, dtype=torch.bool),
            z,
            z,
            z,
            z,
        )
    gen_t = torch.cat(gen)
    return LengthRows(
        torch.cat(hid),
        torch.cat(rem),
        torch.cat(fin),
        torch.cat(seq),
        gen_t,
        torch.cat(plen),
        torch.full_like(gen_t, int(cap)),
    )


def _positive_weight(y: torch.Tensor, known: torch.Tensor, how: str | None) -> torch.Tensor | None:
    if how is None:
        return None
    pos = (y & known).sum(0).float()
    neg = (~y & known).sum(0).float()
    w = neg / pos.clamp_min(1)
    if how == "sqrt":
        w = w.sqrt()
    elif how != "balanced":
        raise ValueError(f"pos_weight must be None, 'balanced' or 'sqrt', got {how!r}")
    return w.clamp(1.0, 100.0)


def _feature_inputs(model: LengthPredictor, rows: LengthRows, idx, device: str) -> dict:
    out = {}
    for name, v in rows.features().items():
        if name in model.cfg.features:
            if v is None:
                raise ValueError(f"the model needs feature {name!r}, which the rows lack")
            out[name] = v[idx].to(device)
    return out


def train_length_predictor(
    model: LengthPredictor, rows: LengthRows, cfg: LengthTrainConfig, val: LengthRows | None = None
) -> tuple[LengthPredictor, dict]:
    torch.manual_seed(cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed)
    model = model.to(cfg.device).train()
    y, known = rows.labels(model.cfg.thresholds, cfg.mask)
    pw = _positive_weight(y, known, cfg.pos_weight)
    pw = None if pw is None else pw.to(cfg.device)
    hidden = rows.hidden.to(cfg.device)  # one copy on the device, batches indexed there
    y, known = y.to(cfg.device), known.to(cfg.device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    n = len(rows.remaining)
    steps = cfg.epochs * max(1, (n + cfg.batch_rows - 1) // cfg.batch_rows)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=cfg.lr, total_steps=max(1, steps), pct_start=0.1
    )
    history = []
    t0 = time.time()
    best_state, best_val = None, float("inf")
    for epoch in range(cfg.epochs):
        model.train()
        perm = torch.randperm(n, generator=g).to(cfg.device)
        total, count = 0.0, 0.0
        for s in tqdm(
            range(0, n, cfg.batch_rows),
            desc=f"train-length epoch {epoch + 1}/{cfg.epochs}",
            unit="batch",
            leave=False,
        ):
            idx = perm[s : s + cfg.batch_rows]
            logits = model(
                hidden[idx].float(), **_feature_inputs(model, rows, idx.cpu(), cfg.device)
            )
            k = known[idx].float()
            loss = (
                F.binary_cross_entropy_with_logits(
                    logits, y[idx].float(), reduction="none", pos_weight=pw
                )
                * k
            ).sum()
            opt.zero_grad(set_to_none=True)
            (loss / k.sum().clamp_min(1)).backward()
            opt.step()
            sched.step()
            total += float(loss.detach())
            count += float(k.sum())
        entry = {
            "epoch": epoch + 1,
            "train_bce": total / max(count, 1),
            "seconds": time.time() - t0,
        }
        if val is not None and len(val.remaining):
            vb = _bce(model, val, cfg.device, cfg.mask)
            entry["val_bce"] = vb
            if vb < best_val:
                best_val = vb
                best_state = {k_: v.detach().clone() for k_, v in model.state_dict().items()}
        history.append(entry)
        logger.info("length predictor epoch %d: %s", epoch + 1, entry)
    if best_state is not None:
        model.load_state_dict(best_state)
    return model.eval(), {"history": history, "seconds": time.time() - t0, "rows": n}


@torch.no_grad()
def predict_probs(
    model: LengthPredictor, rows: LengthRows, device: str = "cpu", batch: int = 8192
) -> torch.Tensor:
    model = model.to(device).eval()
    out = [
        model.probabilities(
            rows.hidden[s : s + batch].to(device).float(),
            **_feature_inputs(model, rows, slice(s, s + batch), device),
        ).cpu()
        for s in range(0, len(rows.remaining), batch)
    ]
    return torch.cat(out) if out else torch.zeros(0, len(model.cfg.thresholds))


@torch.no_grad()
def _bce(model: LengthPredictor, rows: LengthRows, device: str, mask: str = "known") -> float:
    p = predict_probs(model, rows, device).clamp(1e-7, 1 - 1e-7)
    y, known = rows.labels(model.cfg.thresholds, mask)
    bce = -(y.float() * p.log() + (1 - y.float()) * (1 - p).log())
    return float((bce * known).sum() / known.sum().clamp_min(1))


def precision_recall(probs: np.ndarray, y: np.ndarray, known: np.ndarray, cutoff: float) -> dict:
    pred = (probs >= cutoff) & known
    tp = int((pred & y).sum())
    fp = int((pred & ~y).sum())
    pos = int((y & known).sum())
    return {
        "precision": tp / (tp + fp) if tp + fp else float("nan"),
        "recall": tp / pos if pos else float("nan"),
        "predicted": tp + fp,
        "positives": pos,
        "rows": int(known.sum()),
    }


def calibrate_cutoffs(
    probs: torch.Tensor,
    rows: LengthRows,
    thresholds: tuple[int, ...],
    target_precision: float = 0.8,
    min_predicted: int = 20,
    mask: str = "known",
) -> tuple[list[float], list[dict]]:
    """Per threshold, the lowest cutoff whose validation precision reaches the target.

    Lowest = most recall. Cutoffs predicting fewer than ``min_predicted`` rows are ignored (too
    noisy); if no cutoff qualifies, the cutoff is 1.0 (never predict) and recall is 0.
    """
    y_all, known_all = rows.labels(thresholds, mask)
    cutoffs, stats = [], []
    for k, t in enumerate(thresholds):
        known = known_all[:, k].numpy()
        p = probs[:, k].numpy()[known]
        y = y_all[:, k].numpy()[known]
        order = np.argsort(-p, kind="stable")
        ps, ys = p[order], y[order]
        tp = np.cumsum(ys)
        npred = np.arange(1, len(ys) + 1)
        prec = tp / npred
        # only cut between distinct probabilities
        distinct = np.r_[ps[1:] < ps[:-1], True] if len(ps) else np.zeros(0, dtype=bool)
        ok = distinct & (prec >= target_precision) & (npred >= min_predicted)
        if ok.any():
            j = int(np.nonzero(ok)[0].max())  # deepest point (most recall) that still qualifies
            cutoff = float(ps[j])
        else:
            cutoff = 1.0
        cutoffs.append(cutoff)
        st = precision_recall(
            probs[:, k].numpy(), y_all[:, k].numpy(), known_all[:, k].numpy(), cutoff
        )
        st.update({"threshold": t, "cutoff": cutoff})
        stats.append(st)
        logger.info(
            "threshold %d: cutoff %.4f, val precision %.3f recall %.3f",
            t,
            cutoff,
            st["precision"],
            st["recall"],
        )
    return cutoffs, stats
