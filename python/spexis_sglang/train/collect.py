"""collect: the base model answers prompts itself; record what the heads train on.

For every prompt the base model generates a greedy answer (chat template applied), either with
batched HF ``generate`` (``backend="hf"``) or, much faster on a GPU, with one SGLang server
that gets every prompt of a set at once as token ids (``backend="sglang"``,
:func:`sglang_answers`; continuous batching and CUDA graphs). The full sequence (prompt +
answer) is then run once more, teacher-forced, and for every position we record

* ``tokens``: the token id at the position;
* ``next``: the base model's greedy next token given that prefix (argmax of its logits) -- the
  token a draft made at this position must equal to be accepted;
* ``hidden_{L}``: the residual stream after decoder layer ``L`` (HF's
  ``output_hidden_states[L]``; SGLang's ``hidden_states + residual`` at the end of a stage
  that ends with layer ``L``), captured by a forward hook on layer ``L-1``;
* ``final``: the base's last hidden state after its final norm (the LM head's input), so
  training can distil the base's full next-token distribution without storing logits.

Per sequence we keep the prompt length, the answer length and whether the answer ended with
EOS (else it was cut at ``max_new_tokens`` and its remaining lengths are censored).
``next`` on answer positions equals the generated tokens except on floating-point near-ties
between the cached and the teacher-forced pass; the count is logged and stored.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from spexis_sglang.data.sources import Prompt

logger = logging.getLogger(__name__)


@dataclass
class CollectConfig:
    exits: tuple[int, ...] = (7, 15)
    max_prompt_tokens: int = 1024
    max_new_tokens: int = 192
    batch_size: int = 16
    shard_batches: int = 1  # batches per shard file (a crash loses at most one shard)
    device: str = "cpu"
    # data parallel over processes (one per GPU): worker k of n writes shards k, k+n, ...;
    # any later single-process run finds every shard and writes meta.json
    worker: int = 0
    num_workers: int = 1
    # > 0: a generate batch holds at most this many tokens of KV (rows x (longest prompt +
    # max_new_tokens)), so long-prompt batches shrink and several workers fit one GPU
    batch_tokens: int = 0
    # unix time (0 = none): no shard is started that would end after it (the mean shard time
    # of this run estimates that); shards left over stay for a later run (resume)
    deadline: float = 0.0
    # a merge (a run that finds every worker done) writes meta.json even with shards missing
    # (recorded as ``missing_shards``); a later run still collects them
    allow_partial: bool = False
    # who generates the greedy answers: "hf" (``generate``, per batch) or "sglang" (answers
    # made beforehand for the whole set by :func:`sglang_answers`; collect only teacher-forces)
    backend: str = "hf"
    # dtype the hidden states are stored in: float16, or bfloat16 for a model whose residual
    # stream leaves float16's range (Gemma's reaches ~1e5; :func:`storage_dtype` probes it)
    store_dtype: str = "float16"

    def __post_init__(self) -> None:
        if not 0 <= self.worker < self.num_workers:
            raise ValueError(
                f"collect worker {self.worker} of {self.num_workers}: "
                "need 0 <= worker < num_workers"
            )


@dataclass
class BaseModel:
    """The HF base model with what collection and evaluation need from it."""

    model: torch.nn.Module
    tokenizer: object
    config: object
    eos_ids: tuple[int, ...]
    pad_id: int
    name: str
    path: str = ""

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @property
    def final_norm_weight(self) -> torch.Tensor:
        """The final norm's effective per-channel scale (Llama's ``w``, Gemma's ``1 + w``):
        the norm of an all-ones row, which RMS-normalises to ones before the scale."""
        norm = self.model.model.norm
        eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        param = next(norm.parameters())
        with torch.no_grad():
            ones = torch.ones(1, param.shape[0], dtype=torch.float32, device=param.device)
            scale = (norm(ones)[0].float() * (1.0 + eps) ** 0.5).detach()
        # Llama-style: exactly the stored weight (the rescaling above rounds)
        return param if torch.allclose(scale, param.float(), rtol=1e-5, atol=1e-6) else scale


def load_base_model(
    path: str, device: str = "cpu", name: str | None = None, dtype: str = "float32"
) -> BaseModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    gen = model.generation_config
    eos = gen.eos_token_id if gen.eos_token_id is not None else tok.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    pad = gen.pad_token_id if gen.pad_token_id is not None else eos_ids[0]
    return BaseModel(
        model=model,
        tokenizer=tok,
        config=model.config,
        eos_ids=eos_ids,
        pad_id=int(pad),
        name=name or os.path.basename(os.path.normpath(path)),
        path=path,
    )


def chat_ids(base: BaseModel, messages: list[dict[str, str]]) -> list[int]:
    """The prompt's token ids: the chat template, or for a base model without one the turns'
    text joined by blank lines (what a user sends a base model through ``/generate``)."""
    if not getattr(base.tokenizer, "chat_template", None):
        text = "\n\n".join(m["content"] for m in messages)
        return [int(t) for t in base.tokenizer(text)["input_ids"]]
    out = base.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(t) for t in out]


@torch.no_grad()
def generate_greedy(
    base: BaseModel, prompts: list[list[int]], max_new_tokens: int
) -> list[tuple[list[int], bool]]:
    """Greedy answers (left-padded batched ``generate``): (tokens up to and incl. EOS, finished)."""
    device = next(base.model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), base.pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = base.model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=list(base.eos_ids),
        pad_token_id=base.pad_id,
    )
    results = []
    for row in out[:, width:].tolist():
        answer: list[int] = []
        finished = False
        for t in row:
            answer.append(t)
            if t in base.eos_ids:
                finished = True
                break
        results.append((answer, finished))
    return results


def _answer_from_sglang(out: dict, eos_ids: tuple[int, ...]) -> tuple[list[int], bool]:
    """An SGLang /generate result as ``generate_greedy`` returns it: the answer up to and
    including the first EOS (SGLang leaves a matched stop token out of ``output_ids``)."""
    ids = [int(t) for t in out["output_ids"]]
    for k, t in enumerate(ids):
        if t in eos_ids:
            return ids[: k + 1], True
    reason = (out.get("meta_info") or {}).get("finish_reason") or {}
    matched = reason.get("matched")
    if reason.get("type") == "stop" and isinstance(matched, int) and matched in eos_ids:
        return ids + [matched], True
    return ids, False


def sglang_generate(
    base_url: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: tuple[int, ...],
    chunk: int = 512,
    threads: int = 32,
    deadline: float = 0.0,
) -> list[tuple[list[int], bool] | None]:
    """Greedy answers from a running SGLang server, as :func:`generate_greedy` makes them.

    Token ids in, token ids out (no re-tokenisation); stop on the HF generation config's EOS
    ids (``stop_token_ids``) and at ``max_new_tokens`` (``ignore_eos`` would drop
    ``stop_token_ids`` too; SGLang's own EOS set for this model is the same, an answer that
    stops elsewhere is logged). The prompts go out in concurrent chunks, so the server holds
    all of them at once and batches them itself. With ``deadline`` (unix time) the chunks not
    done by then are left out (``None``; the server is stopped afterwards anyway).
    """
    from concurrent.futures import ThreadPoolExecutor, wait

    import requests

    sampling = {
        "temperature": 0.0,
        "max_new_tokens": max_new_tokens,
        "stop_token_ids": list(eos_ids),
        "skip_special_tokens": False,
    }

    def one(part: list[list[int]]) -> list[tuple[list[int], bool]]:
        r = requests.post(
            base_url + "/generate",
            json={"input_ids": part, "sampling_params": sampling},
            timeout=24 * 3600,
        )
        r.raise_for_status()
        out = r.json()
        out = out if isinstance(out, list) else [out]
        return [_answer_from_sglang(o, eos_ids) for o in out]

    parts = [prompts[i : i + chunk] for i in range(0, len(prompts), chunk)]
    pool = ThreadPoolExecutor(max(1, min(threads, len(parts))))
    futures = [pool.submit(one, part) for part in parts]
    timeout = max(0.0, deadline - time.time()) if deadline else None
    wait(futures, timeout=timeout)
    answers: list = []
    for part, fut in zip(parts, futures):
        answers += fut.result() if fut.done() else [None] * len(part)
    pool.shutdown(wait=False, cancel_futures=True)
    left = sum(a is None for a in answers)
    if left:
        logger.warning(
            "sglang: deadline reached, %d of %d prompts not answered", left, len(answers)
        )
    odd = sum(1 for a in answers if a and not a[1] and len(a[0]) < max_new_tokens)
    if odd:
        logger.warning("sglang: %d answers stopped before the cap without an HF EOS id", odd)
    return answers


def read_answers(path: str, cfg: CollectConfig) -> dict | None:
    """The cached SGLang answers of a set (``{"complete", "answers"}``), None if absent/stale."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        cached = json.load(f)
    if cached.get("max_new_tokens") != cfg.max_new_tokens:
        return None
    return cached


def sglang_answers(
    base: BaseModel,
    base_url: str | None,
    prompts: list[Prompt],
    cfg: CollectConfig,
    path: str,
    deadline: float = 0.0,
) -> dict[str, dict]:
    """Every prompt's final-round prompt ids and greedy answer from a running SGLang server.

    Round by round over the whole set (one big request batch per round): a multi-turn
    prompt's earlier answers are decoded into its chat exactly as the HF path does. The
    result is cached in ``path`` (JSON by uid), so a resumed collect does not regenerate.
    With ``deadline``, prompts not answered by then are left out (cached as incomplete; a
    later call with a server answers the rest and drops the set's shards, whose layout
    changes). ``base_url`` None: the cache only.
    """
    cached = read_answers(path, cfg)
    if cached and (cached["complete"] or base_url is None):
        return cached["answers"]
    if base_url is None:
        return {}
    prev = cached["answers"] if cached else {}
    t0 = time.time()
    chats = {p.uid: p.chat() for p in prompts}
    ids = {p.uid: chat_ids(base, chats[p.uid]) for p in prompts}
    # the same filter as collect: prompts too long are not generated at all
    wanted = [
        p
        for p in prompts
        if len(ids[p.uid]) + (cfg.max_new_tokens + 64) * len(p.followups) <= cfg.max_prompt_tokens
    ]
    todo = [p for p in wanted if p.uid not in prev]
    answers: dict[str, tuple[list[int], bool]] = {}
    rounds = max((len(p.followups) for p in todo), default=-1) + 1
    for r in range(rounds):
        batch = [p for p in todo if len(p.followups) >= r]
        if r:
            for p in batch:
                text = base.tokenizer.decode(answers[p.uid][0], skip_special_tokens=True)
                chats[p.uid] = chats[p.uid] + [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": p.followups[r - 1]},
                ]
                ids[p.uid] = chat_ids(base, chats[p.uid])
        new = sglang_generate(
            base_url,
            [ids[p.uid] for p in batch],
            cfg.max_new_tokens,
            base.eos_ids,
            deadline=deadline,
        )
        for p, a in zip(batch, new):
            if a is None:
                answers.pop(p.uid, None)  # an earlier round's answer is no final answer
            else:
                answers[p.uid] = a
        todo = [p for p in todo if p.uid in answers]
    out = dict(prev)
    for p in todo:
        out[p.uid] = {
            "prompt_ids": ids[p.uid],
            "answer": answers[p.uid][0],
            "finished": answers[p.uid][1],
        }
    n = sum(len(answers[p.uid][0]) for p in todo)
    dt = time.time() - t0
    logger.info(
        "sglang: %d answers, %d answer tokens in %.0f s (%.0f tokens/s); %d of %d prompts answered",
        len(todo),
        n,
        dt,
        n / max(dt, 1e-9),
        len(out),
        len(wanted),
    )
    out_dir = os.path.dirname(os.path.abspath(path))
    os.makedirs(out_dir, exist_ok=True)
    if prev and todo:  # more answers than the shards on disk were cut from: a new layout
        for fn in os.listdir(out_dir):
            if fn.startswith("shard-") or fn == "meta.json":
                os.remove(os.path.join(out_dir, fn))
    with open(path + ".tmp", "w") as f:
        json.dump(
            {
                "max_new_tokens": cfg.max_new_tokens,
                "complete": len(out) == len(wanted),
                "seconds": dt,
                "answers": out,
            },
            f,
        )
    os.replace(path + ".tmp", path)
    return out


@torch.no_grad()
def teacher_forced(
    base: BaseModel,
    sequences: list[list[int]],
    exits: tuple[int, ...],
    chunk: int = 64,
    store_dtype: torch.dtype = torch.float16,
) -> list[dict[str, torch.Tensor]]:
    """One right-padded forward over full sequences: next tokens, exit and final hidden states."""
    device = next(base.model.parameters()).device
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), base.pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    captured: dict[int, torch.Tensor] = {}
    layers = base.model.model.layers
    handles = []
    for layer_idx in exits:

        def hook(_mod, _inp, out, layer_idx=layer_idx):
            captured[layer_idx] = out[0] if isinstance(out, tuple) else out

        handles.append(layers[layer_idx - 1].register_forward_hook(hook))
    try:
        out = base.model.model(input_ids=ids.to(device), attention_mask=mask.to(device))
    finally:
        for h in handles:
            h.remove()
    final = out.last_hidden_state
    w = base.lm_head_weight
    nxt = torch.empty(final.shape[:2], dtype=torch.long, device=device)
    for s in range(0, width, chunk):
        nxt[:, s : s + chunk] = (final[:, s : s + chunk] @ w.t()).argmax(-1)
    records = []
    for i, s in enumerate(sequences):
        n = len(s)
        rec = {
            "tokens": ids[i, :n].to(torch.int32),
            "next": nxt[i, :n].to("cpu", torch.int32),
            "final": final[i, :n].to("cpu", store_dtype),
        }
        for layer_idx in exits:
            rec[f"hidden_{layer_idx}"] = captured[layer_idx][i, :n].to("cpu", store_dtype)
        records.append(rec)
    return records


def _prompt_rounds(p: Prompt) -> list[str]:
    return list(p.followups)


# shard times of the set this process collected last (the deadline's estimate for the next set)
_LAST_SHARD_SECONDS: list[float] = []


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e)


def _halving(fn, items: list, *args):
    """``fn(items, *args)``, split in halves (recursively) when the device runs out of memory.

    Several collect workers share one GPU; a batch that meets the others' peaks is retried in
    smaller pieces instead of killing the worker.
    """
    try:
        return fn(items, *args)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not _is_oom(e) or len(items) < 2:
            raise
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    half = len(items) // 2
    logger.warning(
        "out of memory on a batch of %d; retrying as %d + %d", len(items), half, len(items) - half
    )
    return _halving(fn, items[:half], *args) + _halving(fn, items[half:], *args)


def make_batches(
    lengths: list[int], batch_size: int, batch_tokens: int = 0, new_tokens: int = 0
) -> list[list[int]]:
    """Consecutive index groups (inputs sorted by length) of at most ``batch_size`` rows and,
    with ``batch_tokens``, at most that many rows x (longest prompt + ``new_tokens``)."""
    batches: list[list[int]] = []
    cur: list[int] = []
    width = 0
    for i, n in enumerate(lengths):
        w = max(width, n + new_tokens)
        if cur and (len(cur) >= batch_size or (batch_tokens and w * (len(cur) + 1) > batch_tokens)):
            batches.append(cur)
            cur, w = [], n + new_tokens
        cur.append(i)
        width = w
    if cur:
        batches.append(cur)
    return batches


def shard_order(indices: list[int], tag: str) -> list[int]:
    """A worker's shards in a seeded random order: with a deadline, the shards left over are a
    random subset, not the longest prompts (shards follow the length-sorted prompts)."""
    import random

    out = list(indices)
    random.Random(f"shards:{tag}").shuffle(out)
    return out


def _generate_batch(base: BaseModel, batch: list, cfg: CollectConfig):
    """HF backend: one batch's final-round prompt ids and greedy answers (multi-turn rounds)."""
    chats = [p.chat() for p, _ in batch]
    prompt_ids = [ids for _, ids in batch]
    answers = _halving(lambda ps: generate_greedy(base, ps, cfg.max_new_tokens), prompt_ids)
    # multi-turn: the model's own answer becomes context for the next user turn
    max_rounds = max(len(p.followups) for p, _ in batch)
    for r in range(max_rounds):
        todo = [i for i, (p, _) in enumerate(batch) if len(p.followups) > r]
        for i in todo:
            text = base.tokenizer.decode(answers[i][0], skip_special_tokens=True)
            chats[i] = chats[i] + [
                {"role": "assistant", "content": text},
                {"role": "user", "content": batch[i][0].followups[r]},
            ]
            prompt_ids[i] = chat_ids(base, chats[i])
        new = _halving(
            lambda ps: generate_greedy(base, ps, cfg.max_new_tokens),
            [prompt_ids[i] for i in todo],
        )
        for i, a in zip(todo, new):
            answers[i] = a
    return prompt_ids, answers


def collect(
    base: BaseModel,
    prompts: list[Prompt],
    out_dir: str,
    cfg: CollectConfig,
    split_name: str,
    desc: str | None = None,
    answers: dict[str, dict] | None = None,
) -> dict:
    """Generate and record ``prompts`` into ``out_dir`` (shards + ``meta.json``); resumable.

    ``answers`` (backend "sglang": :func:`sglang_answers`, by uid): the greedy answers are
    given; only the teacher-forced pass runs, over batches of similar full-sequence length.

    With ``cfg.num_workers > 1`` only this worker's shards are made and ``meta.json`` is
    written only if every shard already exists; the returned dict then has ``partial``.
    """
    os.makedirs(out_dir, exist_ok=True)
    done_marker = os.path.join(out_dir, "meta.json")
    if os.path.isfile(done_marker):
        with open(done_marker) as f:
            meta = json.load(f)
        if (
            meta.get("config") == _jsonable(cfg)
            and meta.get("n_prompts") == len(prompts)
            and not meta.get("missing_shards")
        ):
            logger.info(
                "%s already collected (%d sequences); skipping", out_dir, len(meta["sequences"])
            )
            return meta
    _drop_stale_shards(out_dir, cfg)
    # Drop prompts whose (first-round) template is too long; sort by length to limit padding.
    encoded = []
    not_answered = 0
    if answers is not None:
        # answers known: sort and batch by the full sequence (prompt + answer) the
        # teacher-forced pass runs over, so its batches are full and barely padded
        for p in prompts:
            if p.uid in answers:
                a = answers[p.uid]
                encoded.append((p, a["prompt_ids"] + a["answer"]))
            elif (
                len(chat_ids(base, p.chat())) + (cfg.max_new_tokens + 64) * len(p.followups)
                <= cfg.max_prompt_tokens
            ):
                not_answered += 1  # the generation deadline came first
        skipped = len(prompts) - len(encoded) - not_answered
        encoded.sort(key=lambda x: (len(x[1]), x[0].uid))
        groups = make_batches([len(s) for _, s in encoded], cfg.batch_size, cfg.batch_tokens)
    else:
        for p in prompts:
            ids = chat_ids(base, p.chat())
            if len(ids) + (cfg.max_new_tokens + 64) * len(p.followups) <= cfg.max_prompt_tokens:
                encoded.append((p, ids))
        skipped = len(prompts) - len(encoded)
        encoded.sort(key=lambda x: (len(x[1]), x[0].uid))
        groups = make_batches(
            [len(ids) for _, ids in encoded], cfg.batch_size, cfg.batch_tokens, cfg.max_new_tokens
        )
    batches = [[encoded[i] for i in g] for g in groups]
    shards = [batches[i : i + cfg.shard_batches] for i in range(0, len(batches), cfg.shard_batches)]
    t0 = time.time()
    sequences_meta: list[dict] = []
    n_tokens = 0
    mismatches = 0
    worker_seconds_path = os.path.join(out_dir, f"seconds-worker{cfg.worker}.json")
    mine = [i for i in range(len(shards)) if i % cfg.num_workers == cfg.worker]
    bar = tqdm(
        total=sum(len(b) for i in mine for b in shards[i]),
        desc=desc or f"collect {split_name}",
        unit="prompt",
    )
    stopped = 0
    new_shard_seconds: list[float] = []
    for shard_idx in shard_order(mine, f"{split_name}:{cfg.worker}/{cfg.num_workers}"):
        shard = shards[shard_idx]
        shard_path = os.path.join(out_dir, f"shard-{shard_idx:05d}.safetensors")
        shard_meta_path = shard_path + ".json"
        if os.path.isfile(shard_path) and os.path.isfile(shard_meta_path):
            with open(shard_meta_path) as f:
                smeta = json.load(f)
            sequences_meta.extend(smeta)
            n_tokens += sum(m["length"] for m in smeta)
            mismatches += sum(m["gen_mismatch"] for m in smeta)
            bar.update(sum(len(b) for b in shard))
            continue
        # this set's shards so far, else the last set's (a new set starts no shard it cannot end)
        seen = new_shard_seconds or _LAST_SHARD_SECONDS
        est = sum(seen) / len(seen) if seen else 0.0
        if cfg.deadline and time.time() + est > cfg.deadline:
            stopped += 1
            continue
        t_shard = time.time()
        shard_records: list[dict[str, torch.Tensor]] = []
        smeta: list[dict] = []
        for batch in shard:
            if answers is not None:
                given = [answers[p.uid] for p, _ in batch]
                prompt_ids = [a["prompt_ids"] for a in given]
                gen = [(a["answer"], bool(a["finished"])) for a in given]
            else:
                prompt_ids, gen = _generate_batch(base, batch, cfg)
            seqs = [pi + a for pi, (a, _) in zip(prompt_ids, gen)]
            store = getattr(torch, cfg.store_dtype)
            records = _halving(
                lambda ss: teacher_forced(base, ss, cfg.exits, store_dtype=store), seqs
            )
            for (p, _), pi, (a, finished), rec in zip(batch, prompt_ids, gen, records):
                plen = len(pi)
                # teacher-forced greedy vs the generated continuation (near-ties only)
                gen_mismatch = int(
                    (
                        rec["next"][plen - 1 : plen - 1 + len(a)]
                        != torch.tensor(a, dtype=torch.int32)
                    ).sum()
                )
                mismatches += gen_mismatch
                smeta.append(
                    {
                        "uid": p.uid,
                        "source": p.source,
                        "category": p.category,
                        "split": split_name,
                        "prompt_len": plen,
                        "answer_len": len(a),
                        "length": plen + len(a),
                        "finished": bool(finished),
                        "rounds": 1 + len(p.followups),
                        "gen_mismatch": gen_mismatch,
                    }
                )
                shard_records.append(rec)
                n_tokens += plen + len(a)
            bar.update(len(batch))
            bar.set_postfix(tokens=n_tokens, tok_s=f"{n_tokens / max(1e-9, time.time() - t0):.0f}")
        tensors = {k: torch.cat([r[k] for r in shard_records]) for k in shard_records[0]}
        # written under a temporary name first: parallel workers read each other's shards
        save_file(tensors, shard_path + ".tmp")
        os.replace(shard_path + ".tmp", shard_path)
        with open(shard_meta_path + ".tmp", "w") as f:
            json.dump(smeta, f)
        os.replace(shard_meta_path + ".tmp", shard_meta_path)
        sequences_meta.extend(smeta)
        new_shard_seconds.append(time.time() - t_shard)
        _LAST_SHARD_SECONDS[:] = new_shard_seconds
    bar.close()
    seconds = time.time() - t0
    if stopped:
        logger.info(
            "%s: deadline reached, %d shards of worker %d left", split_name, stopped, cfg.worker
        )
    if cfg.num_workers > 1:
        with open(worker_seconds_path, "w") as f:
            json.dump({"seconds": seconds, "num_workers": cfg.num_workers}, f)
    # shards ran in a shuffled order, some by other workers: read every one on disk in order
    sequences_meta, missing, present = [], 0, []
    for shard_idx in range(len(shards)):
        shard_meta_path = os.path.join(out_dir, f"shard-{shard_idx:05d}.safetensors.json")
        if not os.path.isfile(shard_meta_path):
            missing += 1
            continue
        present.append(shard_idx)
        with open(shard_meta_path) as f:
            sequences_meta.extend(json.load(f))
    n_tokens = sum(m["length"] for m in sequences_meta)
    mismatches = sum(m["gen_mismatch"] for m in sequences_meta)
    if missing and not (cfg.allow_partial and cfg.num_workers == 1):
        logger.info(
            "%s: worker %d of %d done, %d shards left to other workers",
            out_dir,
            cfg.worker,
            cfg.num_workers,
            missing,
        )
        return {"partial": True, "missing_shards": missing, "seconds": seconds}
    # a merge after parallel workers: the set took as long as its slowest worker
    worker_seconds = []
    for fn in sorted(os.listdir(out_dir)):
        if fn.startswith("seconds-worker") and fn.endswith(".json"):
            with open(os.path.join(out_dir, fn)) as f:
                worker_seconds.append(float(json.load(f)["seconds"]))
    meta = {
        "config": _jsonable(cfg),
        "n_prompts": len(prompts),
        "skipped_too_long": skipped,
        # backend sglang: prompts the generation deadline left unanswered (not in the set)
        "not_answered": not_answered,
        "n_shards": len(shards),
        # with allow_partial: the shards present (a later run collects the others)
        "shards": present,
        "missing_shards": missing,
        "sequences": sequences_meta,
        "n_tokens": n_tokens,
        "n_answer_tokens": sum(m["answer_len"] for m in sequences_meta),
        "gen_mismatches": mismatches,
        "seconds": max([seconds] + worker_seconds),
        "parallel_workers": max(1, len(worker_seconds)),
        "base_model": base.name,
    }
    with open(done_marker, "w") as f:
        json.dump(meta, f)
    logger.info(
        "collected %s: %d sequences, %d tokens (%d answer tokens), %d generate/teacher-forced "
        "mismatches, %.0f s",
        split_name,
        len(sequences_meta),
        n_tokens,
        meta["n_answer_tokens"],
        mismatches,
        meta["seconds"],
    )
    return meta


def _drop_stale_shards(out_dir: str, cfg: CollectConfig) -> None:
    """Shards collected with other settings (answer cap, exits, storage dtype, ...) are not
    resumed from: deleted, with a warning. The settings are kept in ``collect-config.json``."""
    path = os.path.join(out_dir, "collect-config.json")
    want = _jsonable(cfg)
    if os.path.isfile(path):
        with open(path) as f:
            have = json.load(f)
        if have != want:
            stale = [
                fn for fn in os.listdir(out_dir) if fn.startswith("shard-") or fn == "meta.json"
            ]
            logger.warning(
                "%s: %d files were collected with other settings; collecting again",
                out_dir,
                len(stale),
            )
            for fn in stale:
                os.remove(os.path.join(out_dir, fn))
    with open(f"{path}.{os.getpid()}.tmp", "w") as f:
        json.dump(want, f)
    os.replace(f"{path}.{os.getpid()}.tmp", path)


def _jsonable(cfg: CollectConfig) -> dict:
    """What the data depends on (not how the work was split)."""
    d = json.loads(json.dumps(asdict(cfg)))
    for k in ("worker", "num_workers", "deadline", "allow_partial"):
        d.pop(k)
    if d.get("store_dtype") == "float16":  # the default: sets collected before it still match
        d.pop("store_dtype")
    return d


# what float16 storage may hold with room to spare (its largest finite value is 65504;
# SmolLM2-135M peaks near 2.5e4 on its first token, Gemma 3 270M near 8e4)
FLOAT16_SAFE = 2.0**15


def storage_dtype(base: BaseModel, exits: tuple[int, ...]) -> str:
    """float16, unless a probe's exit or final hidden states leave float16's safe range."""
    ids = chat_ids(base, [{"role": "user", "content": "Explain in detail how a city works."}])
    rec = teacher_forced(base, [ids], exits, store_dtype=torch.float32)[0]
    peak = max(float(v.abs().max()) for k, v in rec.items() if k.startswith(("hidden_", "final")))
    dtype = "float16" if peak < FLOAT16_SAFE else "bfloat16"
    logger.info("hidden states peak at %.3g on a probe: stored as %s", peak, dtype)
    return dtype


@dataclass
class Collected:
    """All sequences of one collected set, concatenated (``offsets[i]`` = start of sequence i)."""

    meta: list[dict]
    offsets: torch.Tensor
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    max_new_tokens: int | None = None  # the answer cap the set was collected with

    def __len__(self) -> int:
        return len(self.meta)

    def sequence(self, i: int, key: str) -> torch.Tensor:
        s = int(self.offsets[i])
        return self.tensors[key][s : s + self.meta[i]["length"]]


def capped(data: Collected, cap: int) -> Collected:
    """The set as a collection with answer cap ``cap`` would have recorded it (greedy answers
    are prefixes of longer-cap ones): answers cut at ``cap``, ended only if they ended by then.

    A view (same tensors and offsets), so one long-cap collection also gives numbers
    comparable with an earlier, shorter-cap run. Multi-turn sets differ in their earlier
    turns' context, which a shorter cap would have cut too.
    """
    from dataclasses import replace

    meta = []
    for m in data.meta:
        a = min(m["answer_len"], cap)
        meta.append(
            {
                **m,
                "answer_len": a,
                "length": m["prompt_len"] + a,
                "finished": bool(m["finished"]) and m["answer_len"] <= cap,
            }
        )
    return replace(data, meta=meta, max_new_tokens=cap)


def load_collected(out_dir: str, keys: tuple[str, ...] | None = None) -> Collected:
    with open(os.path.join(out_dir, "meta.json")) as f:
        meta = json.load(f)
    lengths = torch.tensor([m["length"] for m in meta["sequences"]], dtype=torch.long)
    total = int(lengths.sum())
    # filled shard by shard into tensors allocated once: concatenating a list of shards would
    # hold every row twice (tens of GB for the larger presets, several loaders at once)
    tensors: dict[str, torch.Tensor] = {}
    pos = 0
    for shard_idx in meta.get("shards", range(meta["n_shards"])):
        t = load_file(os.path.join(out_dir, f"shard-{shard_idx:05d}.safetensors"))
        n = 0
        for k, v in t.items():
            if keys is None or k in keys:
                if k not in tensors:
                    tensors[k] = torch.empty((total,) + tuple(v.shape[1:]), dtype=v.dtype)
                tensors[k][pos : pos + len(v)] = v
            n = len(v)
        pos += n
        del t
    if pos != total:
        raise ValueError(f"{out_dir}: shards hold {pos} rows, meta.json says {total}")
    offsets = torch.zeros_like(lengths)
    if len(lengths):
        offsets[1:] = torch.cumsum(lengths, 0)[:-1]
    cap = meta.get("config", {}).get("max_new_tokens")
    return Collected(
        meta=meta["sequences"],
        offsets=offsets,
        tensors=tensors,
        max_new_tokens=None if cap is None else int(cap),
    )
