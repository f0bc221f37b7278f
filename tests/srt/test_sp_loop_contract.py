"""The SP loop's contract on stage 0, on the CPU, without a model or a server.

The real :class:`SpexisScheduler` runs its loop (``sp_iteration``: schedule, collect, launch,
send, verify) with SGLang's own ``Req``, request pool, chunk cache, abort handling and stream
plumbing. What lies below it, the device and the other pipeline stages, is scripted
(:class:`ScriptedStages`, which sits between ``SpexisScheduler`` and SGLang's ``Scheduler``
in the method resolution order):

* a forward writes each row's input token into a token-level KV pool at the row's KV slot and
  reads the row's context back from its request's slots, as attention would;
* the last stage's "target" gives the next token as a function of that context, and stage 0's
  "draft head" agrees with it with probability ``theta`` (both deterministic in the context);
* the outputs come back ``N`` iterations after their launch, as from the last stage.

A row built on a rejected draft, or one that read a stale or foreign KV slot, therefore yields a
wrong token, and the outputs equal what the target alone produces only if the loop discards
exactly the rows it must. Asserted: every request's output is the target's (a prefix of it when
aborted), no KV slot and no request slot leaks, and the counters (``SPStats``) count what the
device saw: rows by kind, redone rows, rows on a wrong context discarded, committed tokens,
selective drops, retractions.
"""

from __future__ import annotations

import zlib
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Deque, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch

from spexis_sglang.cpu_support import activate

activate()

from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject  # noqa: E402
from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.managers.io_struct import AbortReq  # noqa: E402
from sglang.srt.managers.schedule_batch import Req, ReqKvInfo  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (  # noqa: E402
    NewTokenRatioTracker,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.chunk_cache import ChunkCache  # noqa: E402
from sglang.srt.mem_cache.common import release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import (  # noqa: E402
    ForwardMode,
    PPProxyTensors,
)
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from spexis_sglang.srt.config import SpexisConfig  # noqa: E402
from spexis_sglang.srt.protocol import (  # noqa: E402
    PLACEHOLDER_TOKEN,
    PROXY_DRAFT_CONF,
    PROXY_DRAFT_HIDDEN,
    PROXY_DRAFT_HOST,
    PROXY_DRAFT_IDS,
    pack_drafts,
)
from spexis_sglang.srt.sp_scheduler import SpexisScheduler  # noqa: E402

VOCAB = 64
EOS = VOCAB - 1
CONTEXT = 256
#: what SamplingParams.normalize reads of a tokenizer (no stop strings here)
TOKENIZER = SimpleNamespace(eos_token_id=EOS, additional_stop_token_ids=None)


@pytest.fixture(scope="module", autouse=True)
def runtime_context():
    """SGLang's release, abort and batch code read the server's runtime context (stage 0 of
    two, one TP rank)."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    from spexis_sglang.default_model import ensure_default_model

    runtime_context.publish(
        ServerArgs(model_path=ensure_default_model(), device="cpu", pp_size=2),
        role="scheduler",
    )
    with runtime_context.get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0):
        yield


# ----------------------------------------------------------------------------- the script


def _hash(context, salt: int) -> int:
    return zlib.crc32(np.asarray(list(context) + [salt], dtype=np.int64).tobytes())


def target(context) -> int:
    """The model's greedy next token after ``context`` (EOS about one time in 64)."""
    return _hash(context, 0) % VOCAB


def draft(context, theta: float) -> Tuple[int, float]:
    """Stage 0's draft after ``context`` and its confidence: the target's token w.p. theta."""
    t, u = target(context), _hash(context, 1)
    conf = 0.05 + 0.9 * ((u >> 10) % 1000) / 1000
    if u % 1000 < theta * 1000:
        return t, conf
    return (t + 1 + (u >> 20) % (VOCAB - 1)) % VOCAB, conf


def reference(prompt: List[int], max_new: int) -> List[int]:
    """What plain decoding with the target returns."""
    context, out = list(prompt), []
    while len(out) < max_new:
        t = target(context)
        out.append(t)
        context.append(t)
        if t == EOS:
            break
    return out


class _CountingMatcher:
    """A matcher that allows every token and terminates after ``length`` of them."""

    def __init__(self, length: int):
        self.length, self.accepted = length, 0

    def accept_token(self, token: int) -> bool:
        if self.is_terminated():
            return False
        self.accepted += 1
        return True

    def rollback(self, k: int) -> None:
        self.accepted -= k

    def is_terminated(self) -> bool:
        return self.accepted >= self.length


class CountingGrammar(XGrammarGrammar):
    """An xgrammar grammar object (the backend SP serves) whose language is every string of
    ``length`` tokens: the request finishes at the token after the ``length``-th, as stock."""

    def __init__(self, length: int):
        BaseGrammarObject.__init__(self)
        self.matcher = _CountingMatcher(length)

    def accept_token(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise ValueError(f"token {token} after the grammar terminated")

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device) -> torch.Tensor:
        return torch.zeros(batch_size, vocab_size, dtype=torch.bool)

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        vocab_mask[idx] = True

    @staticmethod
    def move_vocab_mask(vocab_mask: torch.Tensor, device) -> torch.Tensor:
        return vocab_mask


def grammar_reference(prompt: List[int], max_new: int, length: int) -> List[int]:
    """Stock SGLang's output under a grammar that terminates after ``length`` tokens."""
    return reference(prompt, max_new)[: length + 1]


@dataclass
class Arrival:
    rid: str
    prompt: List[int]
    max_new: int
    at: int  # the loop iteration it arrives in
    grammar_length: Optional[int] = None  # a grammar that terminates after so many tokens


class KVSlots:
    """The KV pool's slot allocator at page size 1 (SGLang's TokenToKVPoolAllocator's
    interface), refusing a double free; slot 0 is the padding slot, never handed out."""

    page_size = 1
    device = "cpu"

    def __init__(self, size: int):
        self.size = size
        self.free_slots = list(range(1, size + 1))
        self.free_set = set(self.free_slots)

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        self.free_set.difference_update(out)
        return torch.tensor(out, dtype=torch.int64)

    def free(self, indices: torch.Tensor) -> None:
        for i in indices.tolist():
            assert 0 < i <= self.size and i not in self.free_set, f"KV slot {i} freed twice"
            self.free_set.add(i)
            self.free_slots.append(i)

    def free_segment(self, indices: torch.Tensor, start_pos: int = 0) -> None:
        self.free(indices)


@dataclass
class DeviceLog:
    """What the scripted device ran, to check the counters against."""

    batches: int = 0
    decode_batches: int = 0
    rows: int = 0
    #: speculative rows the device ran on something else than the latest draft of their
    #: request (the transit batch rejected their chain: they ran as its normal row)
    redone: int = 0
    #: rows whose context is the target's sequence: their token is the target's next one
    right: int = 0
    #: rows whose context is not (built on a rejected draft): their token must be discarded
    wrong: int = 0
    #: rows past a request's last token (its end was not known when they launched)
    beyond: int = 0
    prefill_tokens: int = 0
    #: speculative rows of an iteration below alpha 1 on a draft stage 0 never made
    speculated_on_unmade: int = 0


#: the proxy a decode batch went down the pipe with, beside its outputs in ``in_flight``
_PROXY = "proxy"


class ScriptedHead:
    """Stage 0's model as the SP scheduler sees it: it makes a forward's drafts on request
    (the scripted device put them in the head's hidden state), counting how often."""

    spexis_deferred_drafts = True
    spexis_traces_drafts = False

    def __init__(self) -> None:
        self.made = 0

    def spexis_make_drafts(self, tensors, rows, draft_mask=None, trace=None) -> None:
        hidden = tensors.pop(PROXY_DRAFT_HIDDEN)[:rows]
        ids, conf = hidden[:, 0].to(torch.int64), hidden[:, 1].to(torch.float32)
        tensors[PROXY_DRAFT_IDS] = ids
        tensors[PROXY_DRAFT_CONF] = conf
        tensors[PROXY_DRAFT_HOST] = pack_drafts(ids, conf)
        self.made += 1


class ScriptedStages(Scheduler):
    """What SGLang's scheduler does with the device and the other stages, scripted (see the
    module docstring). Only the methods the SP loop reaches below SpexisScheduler."""

    # -- the device -------------------------------------------------------------------------
    def run_batch(self, batch, pp_proxy_tensors=None):
        log: DeviceLog = self.device_log
        log.batches += 1
        req_to_token = self.req_to_token_pool.req_to_token
        kv = self.kv_tokens
        if not batch.forward_mode.is_decode():  # a prefill: the prompt and any earlier output
            tokens = []
            for req in batch.reqs:
                fill = list(req.origin_input_ids) + list(req.output_ids)
                kv[req_to_token[req.req_pool_idx, : len(fill)].numpy()] = fill
                tokens.append(target(fill))
                log.prefill_tokens += 1
            self.in_flight.append({"next_token_ids": torch.tensor(tokens, dtype=torch.int64)})
            return SimpleNamespace(
                pp_hidden_states_proxy_tensors=PPProxyTensors({}), can_run_cuda_graph=False
            )
        log.decode_batches += 1
        self._settle_latest_drafts()
        record = self.sp.record(batch)
        slots = batch.req_pool_indices.tolist()
        lens = batch.seq_lens.tolist()
        ids = batch.input_ids.tolist()
        kv[batch.out_cache_loc.numpy()] = ids
        true, drafts, confs = [], [], []
        for i, (slot, n) in enumerate(zip(slots, lens)):
            context = kv[req_to_token[slot, :n].numpy()]
            assert (context >= 0).all(), "a row read a KV slot nothing was written to"
            context = context.tolist()
            if record.rows.is_spec[i]:  # not where its request's latest draft put it
                log.redone += int((n, ids[i]) != self.latest_draft[slot])
                if not self.latest_made.get(slot, True) and self.sp.alpha.iteration_alpha < 1:
                    log.speculated_on_unmade += 1
            true.append(target(context))
            d, c = draft(context, self.theta)
            drafts.append(d)
            confs.append(c)
            log.rows += 1
            expected = self.expected_sequence[self.sp.req_at[slot].rid]
            if context[: len(expected)] != expected[:n]:
                log.wrong += 1
            elif n < len(expected):
                log.right += 1
            else:
                log.beyond += 1
        # as SGLang's model under SP: the head's "hidden state" (here the drafts it leads to)
        # and placeholder drafts, which the scheduler replaces where it makes the drafts
        # (ScriptedHead.spexis_make_drafts)
        hidden = torch.tensor([drafts, confs], dtype=torch.float64).T
        placeholder = torch.full((len(drafts),), PLACEHOLDER_TOKEN, dtype=torch.int64)
        no_conf = torch.zeros(len(drafts), dtype=torch.float32)
        tensors = {
            PROXY_DRAFT_HIDDEN: hidden,
            PROXY_DRAFT_IDS: placeholder,
            PROXY_DRAFT_CONF: no_conf,
            PROXY_DRAFT_HOST: pack_drafts(placeholder, no_conf),
        }
        # what goes down the pipe and comes back is what the scheduler left there
        self.in_flight.append({"next_token_ids": torch.tensor(true, dtype=torch.int64)})
        self.in_flight[-1][_PROXY] = tensors
        self.unsettled = (slots, lens, tensors, placeholder)
        return SimpleNamespace(
            pp_hidden_states_proxy_tensors=PPProxyTensors(tensors), can_run_cuda_graph=False
        )

    def _settle_latest_drafts(self) -> None:
        """Each slot's latest draft on the device: what the scheduler left in the proxy of the
        previous decode batch (a draft made, or the placeholder of one skipped)."""
        if self.unsettled is None:
            return
        slots, lens, tensors, placeholder = self.unsettled
        made = tensors[PROXY_DRAFT_IDS] is not placeholder
        for slot, n, d in zip(slots, lens, tensors[PROXY_DRAFT_IDS].tolist()):
            self.latest_draft[slot] = (n + 1, d)
            self.latest_made[slot] = made
        self.unsettled = None

    # -- the other stages -------------------------------------------------------------------
    def _pp_recv_dict_from_prev_stage(self):
        outputs = self.in_flight.popleft()  # the last stage's outputs, in launch order
        proxy = outputs.pop(_PROXY, None)
        if proxy is not None:  # the drafts as they went down the pipe
            outputs[PROXY_DRAFT_IDS] = proxy[PROXY_DRAFT_IDS]
        return outputs

    def _pp_recv_proxy_tensors(self):
        return None  # stage 0 has no stage before it

    def _pp_send_dict_to_next_stage(self, tensor_dict, async_send=True, msg_type="default"):
        return []

    def _pp_send_pyobj_to_next_stage(self, data, async_send=False):
        self.relayed.append(data)
        return []

    def _pp_commit_comm_work(self, work):
        pass

    def _pp_prep_batch_result(self, batch, mb_metadata, pp_outputs):
        return pp_outputs.tensors

    # -- requests and SGLang's admission ----------------------------------------------------
    def process_input_requests(self, recv_reqs):
        for req in recv_reqs:
            self._add_request_to_queue(req)

    def _add_request_to_queue(self, req, is_retracted: bool = False):
        self.retracted += int(is_retracted)
        self.waiting_queue.append(req)

    def get_new_batch_prefill(self, running):
        """SGLang's admission, simplified: the queue's head while slots and KV allow."""
        admitted = []
        while self.waiting_queue and len(running.reqs) + len(admitted) < self.max_running:
            req = self.waiting_queue[0]
            fill = len(req.origin_input_ids) + len(req.output_ids)
            if self.token_to_kv_pool_allocator.available_size() < fill + self.kv_headroom:
                break
            self.waiting_queue.pop(0)
            self.req_to_token_pool.alloc([req])
            kv = self.token_to_kv_pool_allocator.alloc(fill)
            self.req_to_token_pool.req_to_token[req.req_pool_idx, :fill] = kv
            req.kv = ReqKvInfo(kv_allocated_len=fill, swa_evicted_seqlen=0)
            req.kv_committed_len = fill
            req.is_retracted = False
            admitted.append(req)
        batch = None
        if admitted:
            batch = SimpleNamespace(
                reqs=admitted,
                chunked_req=None,
                return_logprob=False,
                forward_mode=ForwardMode.EXTEND,
            )
        return SimpleNamespace(batch_to_run=batch)

    def process_batch_result(self, batch, result):
        """SGLang's prefill result: the first token, the finish check, streaming."""
        for req, token in zip(batch.reqs, result["next_token_ids"].tolist()):
            req.output_ids.append(token)
            req.update_finish_state(1)
            if req.grammar is not None:
                req.grammar.accept_token(token)
                req.grammar.finished = req.finished()
            if req.finished():
                release_kv_cache(req, self.tree_cache)
        self.output_streamer.stream_output(batch.reqs, False)


class ContractScheduler(SpexisScheduler, ScriptedStages):
    """SpexisScheduler over the scripted stages, built without SGLang's start-up."""

    def __init__(
        self,
        stages: int,
        theta: float,
        alpha: float,
        kv_size: int = 4096,
        max_running: int = 16,
        kv_headroom: int = 0,
        force_accept: Optional[float] = None,
        **spexis: Any,
    ):
        self.spexis_config = SpexisConfig(
            draft_head="random:0",
            alpha=alpha,
            log_interval=0,
            force_accept=force_accept,
            **spexis,
        )
        self.sp = None
        self.theta = theta
        self.max_running = self.max_running_requests = max_running
        self.kv_headroom = kv_headroom
        self.ps = SimpleNamespace(
            pp_rank=0,
            pp_size=stages,
            tp_rank=0,
            tp_size=1,
            attn_tp_rank=0,
            attn_cp_rank=0,
            attn_tp_size=1,
            attn_cp_size=1,
        )
        self.pp_group = SimpleNamespace(is_first_rank=True, is_last_rank=False)
        # nnodes > 1: SGLang's own relay (stubbed above), not the local pipe
        self.server_args = SimpleNamespace(
            random_seed=0, nnodes=2, device="cpu", disable_cuda_graph=True
        )
        self.model_config = SimpleNamespace(
            vocab_size=VOCAB, think_end_ids=None, is_multimodal=False
        )
        self.spec_algorithm = SpeculativeAlgorithm.NONE
        self.device = "cpu"
        self.req_to_token_pool = ReqToTokenPool(max_running + 1, CONTEXT, "cpu", False)
        self.token_to_kv_pool_allocator = KVSlots(kv_size)
        self.max_total_num_tokens = kv_size
        self.tree_cache = ChunkCache(
            CacheInitParams(
                disable=True,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
                page_size=1,
            )
        )
        self.kv_tokens = np.full(kv_size + 1, -1, dtype=np.int64)
        self.head = ScriptedHead()
        self.unsettled = None
        self.latest_made: Dict[int, bool] = {}
        self.tp_worker = SimpleNamespace(
            model_runner=SimpleNamespace(attn_backend=None, model=self.head)
        )
        self.device_module = torch.get_device_module("cpu")
        self.forward_stream = self.device_module.Stream()
        self.forward_stream_ctx = self.device_module.StreamContext(self.forward_stream)
        self.copy_stream = self.device_module.Stream()
        self.copy_stream_ctx = self.device_module.StreamContext(self.copy_stream)
        self.schedule_stream = self.device_module.current_stream()
        self.inbox: List[Req] = []
        self.request_receiver = SimpleNamespace(
            ps=self.ps,
            recv_skipper=None,
            input_blocker=None,
            scripted_scheduler_hook=None,
            recv_from_tokenizer=None,
            recv_from_rpc=None,
            recv_requests=self._receive,
        )
        self.waiting_queue: List[Req] = []
        self.chunked_req = None
        self.is_mixed_chunk = False  # SGLang's --enable-mixed-chunk (with a chunk size)
        self._pending_chunked_abort_req = None
        self.enable_hicache_storage = False
        self.disaggregation_mode = DisaggregationMode.NULL
        self.dllm_config = None
        self.grammar_manager = SimpleNamespace(abort_requests=lambda recv_req: None)
        self.ipc_channels = SimpleNamespace(
            send_to_tokenizer=SimpleNamespace(send_output=lambda *a, **k: None)
        )
        self.streamed: List[Req] = []
        self.output_streamer = SimpleNamespace(
            stream_output=lambda reqs, *a, **k: self.streamed.extend(reqs)
        )
        self.metrics_reporter = SimpleNamespace(num_generated_tokens=0)
        self.new_token_ratio_tracker = NewTokenRatioTracker(
            init=0.7, min=0.1, decay=0.01, current=0.7
        )
        self.in_flight: Deque[Dict[str, torch.Tensor]] = deque()
        self.relayed: list = []
        self.retracted = 0
        self.device_log = DeviceLog()
        self.latest_draft: Dict[int, Tuple[int, int]] = {}  # slot -> (its context, draft)
        self.expected_sequence: Dict[str, List[int]] = {}
        self.sp_link = None
        self.init_sp_state()
        self.sp.nothing_queued = None

    def _receive(self) -> list:
        out, self.inbox = self.inbox, []
        return out


def make_req(rid: str, prompt: List[int], max_new: int, verify: bool = True, **sampling) -> Req:
    params = SamplingParams(**{"max_new_tokens": max_new, "temperature": 0.0, **sampling})
    params.normalize(TOKENIZER)
    if verify:
        params.verify(VOCAB)
    return Req(rid, "", prompt, params, eos_token_ids={EOS}, vocab_size=VOCAB)


def arrivals(seed: int, n: int, spread: int = 12) -> List[Arrival]:
    rng = np.random.default_rng(seed)
    return [
        Arrival(
            rid=f"r{i}",
            prompt=rng.integers(0, EOS, size=int(rng.integers(3, 12))).tolist(),
            max_new=int(rng.integers(8, 40)),
            at=int(rng.integers(0, spread)),
        )
        for i in range(n)
    ]


@dataclass
class Run:
    sched: ContractScheduler
    reqs: Dict[str, Req]
    aborted: Dict[str, int] = field(default_factory=dict)


def drive(
    sched: ContractScheduler,
    plan: List[Arrival],
    aborts: Optional[Dict[int, str]] = None,
    max_iterations: int = 3000,
) -> Run:
    """Run the loop until every request has finished and nothing is in flight."""
    aborts = aborts or {}
    reqs = {}
    for a in plan:
        reqs[a.rid] = req = make_req(a.rid, a.prompt, a.max_new)
        want = reference(a.prompt, a.max_new)
        if a.grammar_length is not None:
            req.grammar = CountingGrammar(a.grammar_length)
            want = grammar_reference(a.prompt, a.max_new, a.grammar_length)
        sched.expected_sequence[a.rid] = a.prompt + want
    run = Run(sched, reqs)
    it = 0
    while it < max_iterations:
        sched.inbox += [reqs[a.rid] for a in plan if a.at == it]
        if it in aborts:
            rid = aborts[it]
            run.aborted[rid] = len(reqs[rid].output_ids)
            sched.abort_request(AbortReq(rid=rid))
        sched.sp_iteration(it % sched.pp_loop_size)
        it += 1
        done = all(r.finished() for r in reqs.values()) and it > max(a.at for a in plan)
        # then until the batches in flight are back and the released requests drained
        if done and all(b is None for b in sched.mbs) and not sched.sp.draining:
            break
    else:
        raise AssertionError("the loop did not finish every request")
    return run


def check_contract(run: Run, exact_rows: bool = True) -> None:
    sched, sp, log = run.sched, run.sched.sp, run.sched.device_log
    # every output is the target's; an aborted one a prefix of it, at least as long as
    # what it had when the abort came
    for rid, req in run.reqs.items():
        want = sched.expected_sequence[rid][len(req.origin_input_ids) :]
        got = list(req.output_ids)
        if rid in run.aborted:
            assert got == want[: len(got)] and len(got) >= run.aborted[rid], rid
        else:
            assert got == want, rid
            assert req.finished_reason is not None
    # nothing leaks: every KV slot and request slot is back, the SP state is empty
    assert sched.token_to_kv_pool_allocator.available_size() == sched.max_total_num_tokens
    assert len(sched.req_to_token_pool.free_slots) == sched.req_to_token_pool.size
    assert sp.slots.active_slots().size == 0 and sp.slots.num_batches_in_flight == 0
    assert not sp.draining and not sched.in_flight and not sp.batches
    assert all(r.kv is None and r.req_pool_idx is None for r in run.reqs.values())
    # the counters are what the device saw
    st = sp.stats
    assert st.iterations == log.batches
    assert st.decode_iterations == log.decode_batches
    assert st.rows == log.rows and st.rows_spec <= log.rows
    assert st.rows_redone == log.redone and st.rows_redone <= st.rows_spec
    assert st.rows_stale + st.tokens_committed == st.rows  # every row came back once
    committed = sum(len(r.output_ids) for r in run.reqs.values()) - log.prefill_tokens
    assert st.tokens_committed == committed
    assert st.accepted + st.rejected <= st.tokens_committed
    assert st.rows_stale >= log.wrong  # every row on a wrong context was discarded
    if exact_rows:  # nothing released early: exactly those, and the rows past the end
        assert st.tokens_committed == log.right
        assert st.rows_stale == log.wrong + log.beyond
    assert st.retractions == sched.retracted
    d = sp.stats.as_dict()
    assert d["tokens_committed"] == st.tokens_committed and d["rows_redone"] == st.rows_redone
    # the loop's decode-only phase totals leave out every iteration that launched a prefill
    prefills = log.batches - log.decode_batches
    assert prefills > 0 and 0 < sp.phases.decode_iterations <= sp.phases.iterations - prefills


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("theta", [0.0, 0.6, 1.0])
def test_outputs_counters_and_slots(stages: int, theta: float) -> None:
    sched = ContractScheduler(stages, theta, alpha=0.0)
    run = drive(sched, arrivals(seed=stages, n=8))
    check_contract(run)
    st = sched.sp.stats
    assert st.drafts_dropped == 0 and st.retractions == 0
    if theta == 1.0:  # every draft verified is accepted: no row ever runs on a wrong context
        assert st.rejected == 0 and sched.device_log.wrong == 0 and st.accepted > 0
    elif theta == 0.0:
        assert st.accepted == 0 and st.rejected > 0
    else:
        assert st.accepted > 0 and st.rejected > 0 and st.rows_redone > 0


@pytest.mark.parametrize("stages", [2, 3])
def test_selective_speculation_drops_and_stays_lossless(stages: int) -> None:
    sched = ContractScheduler(stages, theta=0.6, alpha=0.3)
    run = drive(sched, arrivals(seed=10 + stages, n=8))
    check_contract(run)
    st = sched.sp.stats
    assert st.drafts_dropped > 0 and st.alpha == 0.3
    # stage 0's drops travel to the later stages in the relayed plan
    relayed = sum(len(p.dropped or ()) for r in sched.relayed for p in r if hasattr(p, "dropped"))
    assert relayed == st.drafts_dropped


@pytest.mark.parametrize("stages", [2, 3])
def test_alpha_one_gives_each_request_a_row_every_n_iterations(stages: int) -> None:
    """At alpha 1 SP runs what stock PP runs: each request one row every N loop iterations,
    the requests spread over N micro-batches.
    The row built on the draft of the request's row in transit stays (the device redoes it
    where the draft is rejected, so it is never wasted), and a draft whose row is not in
    transit yet is held rather than declined; declined, its request would have nothing to
    launch when that row reached transit, and would wait N + 1 iterations instead."""
    sched = ContractScheduler(stages, theta=0.6, alpha=1.0)
    rows_per_iteration: List[int] = []
    step = sched.sp_iteration

    def counted(mb_id: int) -> bool:
        before = sched.sp.stats.rows
        launched = step(mb_id)
        rows_per_iteration.append(sched.sp.stats.rows - before)
        return launched

    sched.sp_iteration = counted
    # eight requests in step with each other, all decoding for 30+ tokens
    plan = [Arrival(f"r{i}", list(range(1 + i, 9 + i)), 40, 0) for i in range(8)]
    run = drive(sched, plan)
    check_contract(run, exact_rows=False)
    first = next(i for i, n in enumerate(rows_per_iteration) if n)
    # four periods of N iterations while all eight run: 4 x 8 rows (declined drafts gave a
    # row every N + 1 iterations: 3 x 8 in this window), spread over the N phases as stock
    # PP's micro-batches (at most ceil(8 / N) rows a batch, not 8 every N iterations)
    window = rows_per_iteration[first : first + 4 * stages]
    assert sum(window) == 4 * 8, rows_per_iteration[: first + 4 * stages]
    assert max(window) == -(-8 // stages), window
    st = sched.sp.stats
    assert st.rows_spec > 0 and st.rows_redone > 0  # the kept rows rode on drafts
    # every iteration not within depth + 1 of an observed one left its drafts unmade; the
    # rows built on them were redone on the true token, and their verdicts are not counted
    assert st.drafts_unmade_forwards > 0 and st.unmade_drafts_verified > 0
    assert sched.head.made + st.drafts_unmade_forwards == st.decode_iterations
    assert sched.device_log.speculated_on_unmade == 0


@pytest.mark.parametrize("stages", [2, 3])
def test_auto_at_alpha_one_skips_the_drafts_nothing_uses(stages: int, monkeypatch) -> None:
    """``auto`` settled at alpha 1 makes drafts only near its explore iterations (alpha 0):
    those launch every speculative row on a draft that was made, their verdicts are the
    only ones credited, and every output stays the target's."""
    from spexis_sglang.srt import sp_alpha

    monkeypatch.setattr(sp_alpha, "AUTO_ALPHA_INITIAL", 1.0)
    sched = ContractScheduler(
        stages, theta=0.6, alpha=0.0, alpha_auto=True, alpha_interval=10**6, alpha_explore=16
    )
    run = drive(sched, [Arrival(f"r{i}", list(range(1 + i, 9 + i)), 60, 0) for i in range(8)])
    check_contract(run, exact_rows=False)
    ctrl, st = sched.sp.alpha, sched.sp.stats
    assert ctrl.online.alpha == 1.0 and ctrl.online.explore_iterations >= 3
    assert st.drafts_unmade_forwards > st.decode_iterations / 2
    assert sched.head.made + st.drafts_unmade_forwards == st.decode_iterations
    assert sched.device_log.speculated_on_unmade == 0
    assert st.unmade_drafts_verified > 0 and ctrl.online.verdicts > 0
    # what was credited are the verdicts on drafts made (theta 0.6), not on placeholders
    assert st.accepted > 0 and st.rejected > 0


@pytest.mark.parametrize("stages", [2, 3])
def test_auto_probes_at_alpha_zero_hold_drafts_and_stay_lossless(stages: int, monkeypatch) -> None:
    """``auto`` at alpha 0 runs a probe iteration at alpha 1 now and then (a latency sample
    at a stock PP micro-batch): its held drafts ride a later batch and every output stays
    the target's."""
    from spexis_sglang.srt import sp_alpha

    monkeypatch.setattr(sp_alpha, "AUTO_ALPHA_INITIAL", 0.0)
    sched = ContractScheduler(
        stages, theta=0.6, alpha=0.0, alpha_auto=True, alpha_interval=10**6, alpha_explore=4
    )
    run = drive(sched, [Arrival(f"r{i}", list(range(1 + i, 9 + i)), 40, 0) for i in range(8)])
    check_contract(run, exact_rows=False)
    online = sched.sp.alpha.online
    assert online.alpha == 0.0 and online.probe_iterations >= 5
    st = sched.sp.stats
    assert st.rows_spec > 0 and st.rows_redone > 0


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("alpha", [0.0, 0.3])
def test_auto_observes_its_explore_iterations_without_waiting_for_the_drafts(
    stages: int, alpha: float, monkeypatch
) -> None:
    """On a GPU the drafts' copy to the host lands after stage 0 has built its next batch.
    ``auto`` observes its explore iterations without reading that copy while it builds a
    batch (here it never reports landed): the candidates are ranked when a verdict needs
    their rank, every verdict is credited, and the outputs stay the target's. At alpha 0
    stage 0 never reads a copy while building; inside (0, 1) it does (its drops need them),
    but not on its explore iterations."""
    from spexis_sglang.srt import sp_alpha
    from spexis_sglang.srt.sp_records import PendingDrafts

    monkeypatch.setattr(sp_alpha, "AUTO_ALPHA_INITIAL", alpha)
    monkeypatch.setattr(PendingDrafts, "ready", lambda self: False)
    sched = ContractScheduler(
        stages, theta=0.6, alpha=0.0, alpha_auto=True, alpha_interval=10**6, alpha_explore=4
    )
    building, reads_while_building = [False], []
    apply_drafts, read = sched.sp_apply_drafts, PendingDrafts.read

    def spied_apply_drafts():
        building[0] = True
        try:
            apply_drafts()
        finally:
            building[0] = False

    def spied_read(self):
        if building[0] and self._packed is not None:
            reads_while_building.append(self)
        return read(self)

    sched.sp_apply_drafts = spied_apply_drafts
    monkeypatch.setattr(PendingDrafts, "read", spied_read)
    run = drive(sched, [Arrival(f"r{i}", list(range(1 + i, 9 + i)), 40, 0) for i in range(8)])
    check_contract(run, exact_rows=False)
    ctrl = sched.sp.alpha
    assert ctrl.online.alpha == alpha and ctrl.online.explore_iterations > 5
    assert (reads_while_building == []) == (alpha == 0.0)
    assert ctrl.deferred_rankings > 0 and ctrl.online.verdicts > 0
    assert ctrl.as_dict()["deferred_rankings"] == ctrl.deferred_rankings
    assert (sched.sp.stats.drafts_dropped > 0) == (alpha > 0.0)


def test_a_full_kv_pool_retracts_and_the_outputs_stay_the_targets() -> None:
    # room for the prompts, little for their growth: speculation gives way, then requests
    # are retracted and prefilled again later
    plan = [Arrival(f"r{i}", list(range(1 + i, 9 + i)), 40, 0) for i in range(6)]
    sched = ContractScheduler(2, theta=0.6, alpha=0.0, kv_size=120, kv_headroom=8)
    run = drive(sched, plan)
    check_contract(run, exact_rows=False)
    st = sched.sp.stats
    assert st.retractions > 0 and sched.retracted == st.retractions
    assert st.drafts_withheld > 0  # speculative rows gave way to memory first


def test_aborted_requests_stop_and_free_their_slots() -> None:
    plan = arrivals(seed=5, n=6, spread=4)
    for a in plan:
        a.max_new = 60  # still running when the aborts come
    sched = ContractScheduler(3, theta=0.6, alpha=0.0)
    run = drive(sched, plan, aborts={20: "r1", 23: "r4"})
    check_contract(run, exact_rows=False)
    for rid in ("r1", "r4"):
        req = run.reqs[rid]
        assert req.finished_reason.to_json()["type"] == "abort"
        assert len(req.output_ids) < 60


@pytest.mark.parametrize("stages", [2, 3])
def test_a_flush_right_after_the_last_token_waits_until_the_loop_is_idle(
    stages: int, monkeypatch
) -> None:
    """A ``/flush_cache`` (or a weight update) that arrives when the last request has its
    last token, while rows it launched on drafts are still in flight, is held until SGLang's
    own idleness check passes, and so is what arrives after it; then both go on in order,
    relayed to the next stage in that iteration."""
    from sglang.srt.managers.io_struct import FlushCacheReqInput

    sched = ContractScheduler(stages, theta=0.0, alpha=0.0)  # every draft rejected
    # what SGLang's is_fully_idle reads beyond the harness
    sched.running_batch = sched.sp.running
    sched.last_batch = None
    sched.enable_overlap = sched.enable_hisparse = sched.enable_hierarchical_cache = False
    sched.dllm_manager = SimpleNamespace(any_staging_reqs=lambda: False)
    sched.grammar_manager.grammar_queue = []
    served: List[Tuple[int, Any, bool]] = []  # (iteration, request, idle when served)
    monkeypatch.setattr(
        sched,
        "process_input_requests",
        lambda reqs: served.extend((sched.sp.iteration, r, sched.is_fully_idle()) for r in reqs),
    )
    req = make_req("r", [1, 2, 3], 12)
    sched.expected_sequence["r"] = [1, 2, 3] + reference([1, 2, 3], 12)
    sched.inbox.append(req)
    sched.waiting_queue.append(req)  # (the stub above does not queue it)
    it = 0
    while not req.finished():
        sched.sp_iteration(it % sched.pp_loop_size)
        it += 1
    assert not sched.is_fully_idle()  # its rows are in flight
    flush, later = FlushCacheReqInput(), make_req("later", [4, 5], 4)
    sched.inbox += [flush, later]
    arrived = sched.sp.iteration
    served.clear()
    sched.relayed.clear()
    for _ in range(3 * sched.pp_loop_size):
        sched.sp_iteration(it % sched.pp_loop_size)
        it += 1
    assert [r for _, r, _ in served] == [flush, later]
    (at, _, idle), (at_later, _, _) = served
    assert idle and at == at_later and at > arrived  # held, then served idle, in order
    assert not sched.sp.held_requests
    assert [p for p in sched.relayed if flush in p] == [[flush, later]]


def test_a_request_ending_at_its_first_token_never_decodes() -> None:
    # max_new_tokens 1: the prefill finishes it; the loop must not admit it to SP decoding
    plan = [Arrival("one", [1, 2, 3], 1, 0), Arrival("more", [4, 5, 6], 12, 0)]
    sched = ContractScheduler(2, theta=0.6, alpha=0.0)
    run = drive(sched, plan)
    check_contract(run)
    assert len(run.reqs["one"].output_ids) == 1


@pytest.mark.parametrize("stages", [2, 3])
def test_grammar_terminated_requests_finish_at_stocks_token(stages: int) -> None:
    # requests with a grammar take the per-request result path (and stage 0 masks their
    # drafts); the grammar terminates after a few tokens, the others run beside them
    plan = arrivals(seed=20 + stages, n=6)
    for a, length in zip(plan, (2, 5, 9)):
        a.max_new, a.grammar_length = 40, length
        assert len(reference(a.prompt, a.max_new)) > length + 1  # not ended by EOS first
    sched = ContractScheduler(stages, theta=0.6, alpha=0.0)
    run = drive(sched, plan)
    check_contract(run)
    for a in plan[:3]:
        req = run.reqs[a.rid]
        assert len(req.output_ids) == a.grammar_length + 1
        assert req.finished_reason.to_json()["type"] == "stop"


# -------------------------------------------------------------- requests refused on arrival


def arrival_error(
    force_accept: Optional[float] = None, verify: bool = True, **sampling
) -> Optional[str]:
    """What stage 0 answers a request with these sampling parameters on arrival: None when it
    is served (it decodes under SP), else the abort message it finishes with, before it ever
    takes an SP slot."""
    sched = ContractScheduler(2, theta=0.6, alpha=0.0, force_accept=force_accept)
    req = make_req("x", [1, 2, 3], 12, verify, **sampling)
    sched.expected_sequence["x"] = [1, 2, 3] + reference([1, 2, 3], 12)
    sched.inbox.append(req)
    it = 0
    while not req.finished() or any(b is not None for b in sched.mbs) or sched.sp.draining:
        sched.sp_iteration(it % sched.pp_loop_size)
        it += 1
        assert it < 200
    assert sched.token_to_kv_pool_allocator.available_size() == sched.max_total_num_tokens
    assert len(sched.req_to_token_pool.free_slots) == sched.req_to_token_pool.size
    reason = req.finished_reason.to_json()
    if reason["type"] != "abort":
        assert sched.sp.stats.rows > 0  # it decoded under SP
        return None
    assert sched.sp.stats.rows == 0
    return reason["message"]


def test_plain_sampling_is_accepted():
    assert arrival_error() is None
    assert arrival_error(temperature=0.7) is None


@pytest.mark.parametrize(
    "params",
    [
        dict(frequency_penalty=0.1),
        dict(presence_penalty=-0.5),
        dict(repetition_penalty=1.1),
        dict(min_new_tokens=3),
        dict(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.3, min_new_tokens=8),
    ],
)
def test_penalties_and_min_new_tokens_are_served(params):
    """SP sets the penalizers from each row's verified output + drafts (sp_penalties)."""
    assert arrival_error(**params) is None


GRAMMAR_CASES = [
    (dict(regex="[ab]+"), "regex"),
    (dict(json_schema="{}"), "json_schema"),
    (dict(ebnf="root ::= 'a'"), "ebnf"),
    (dict(structural_tag="{}"), "structural_tag"),
    (dict(regex="a", presence_penalty=1.0), "regex"),
    # (SGLang's own check refuses two grammars at once first; the message still names both)
    (dict(regex="a", ebnf="root ::= 'a'"), "regex, ebnf"),
]
_TWO_GRAMMARS = 5


@pytest.mark.parametrize("params, named", GRAMMAR_CASES)
def test_grammars_are_served(params, named):
    """SP masks each row with its grammar after the row's own drafts (sp_grammar); the
    grammar itself is compiled before the request is queued (a stand-in here)."""
    sched = ContractScheduler(2, theta=0.6, alpha=0.0)
    req = make_req("x", [1, 2, 3], 12, params is not GRAMMAR_CASES[_TWO_GRAMMARS][0], **params)
    req.grammar = CountingGrammar(3)
    assert sched._sp_unsupported_error(req) is None


@pytest.mark.parametrize("params, named", GRAMMAR_CASES)
def test_grammars_are_refused_by_name_in_the_forced_acceptance_mode(params, named):
    verify = params is not GRAMMAR_CASES[_TWO_GRAMMARS][0]
    assert arrival_error(force_accept=0.7, verify=verify, **params) == (
        f"Spexis --spexis-benchmark-force-accept does not support {named} (a forced "
        "acceptance can commit a token the grammar forbids); send this request to a server "
        "without it"
    )
    assert arrival_error(force_accept=0.7) is None


def test_a_server_without_sp_serves_everything():
    sched = ContractScheduler(2, theta=0.6, alpha=0.0)
    sched.spexis_config = SpexisConfig()  # no draft head: plain SGLang
    req = make_req("x", [1, 2, 3], 12, frequency_penalty=1.0, regex="a")
    req.grammar = CountingGrammar(3)
    assert not sched.sp_enabled and sched._sp_unsupported_error(req) is None
