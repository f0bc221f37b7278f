"""SP's per-slot sampling state gives the batch SGLang's own ``from_schedule_batch`` would."""

from __future__ import annotations

import random

import numpy as np
import pytest

from spexis_sglang.cpu_support import activate

activate()

from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from spexis_sglang.srt.sp_sampling import SlotSampling, SPSamplingBatchInfo  # noqa: E402

VOCAB = 1000
FIELDS = ("temperatures", "top_ps", "top_ks", "min_ps")
FLAGS = (
    "is_all_greedy",
    "is_any_greedy",
    "need_top_p_sampling",
    "need_top_k_sampling",
    "need_min_p_sampling",
)


@pytest.fixture(scope="module", autouse=True)
def runtime_context():
    """from_schedule_batch reads the server's runtime context."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    from spexis_sglang.default_model import ensure_default_model

    runtime_context.publish(
        ServerArgs(model_path=ensure_default_model(), device="cpu"), role="scheduler"
    )


class _Req:
    def __init__(self, **params):
        self.sampling_params = SamplingParams(**params)
        self.sampling_params.normalize(None)
        self.sampling_params.verify(VOCAB)
        self.return_sampling_mask = False
        self.grammar = None
        self.custom_logit_processor = None


class _Batch:  # weak-referenceable, as the penalizer orchestrator needs
    def __init__(self, reqs):
        self.reqs = reqs
        self.device = "cpu"


def _random_params(rng: random.Random) -> dict:
    params = {"temperature": rng.choice([0.0, 0.3, 0.7, 1.0, 1.5])}
    if rng.random() < 0.5:
        params["top_p"] = rng.choice([1.0, 0.9, 0.5])
    if rng.random() < 0.5:
        params["top_k"] = rng.choice([-1, 1, 5, 50])
    if rng.random() < 0.3:
        params["min_p"] = rng.choice([0.0, 0.05, 0.2])
    return params


@pytest.mark.parametrize("seed", range(20))
def test_gathered_sampling_info_equals_sglangs(seed):
    rng = random.Random(seed)
    capacity = 64
    reqs = [_Req(**_random_params(rng)) for _ in range(rng.randint(1, 12))]
    slots = np.array(rng.sample(range(capacity), len(reqs)), dtype=np.int64)
    sampling = SlotSampling(capacity, VOCAB)
    for slot, req in zip(slots.tolist(), reqs):
        sampling.admit(slot, req)
    batch = _Batch(reqs)
    want = SamplingBatchInfo.from_schedule_batch(batch, VOCAB)
    got = sampling.build(batch, slots)
    for name in FIELDS:
        assert getattr(got, name).tolist() == getattr(want, name).tolist(), name
        assert getattr(got, name).dtype == getattr(want, name).dtype, name
    for name in FLAGS:
        assert getattr(got, name) == getattr(want, name), name
    assert got.penalizer_orchestrator is None and got.logit_bias is None


@pytest.mark.parametrize(
    "params",
    [
        dict(frequency_penalty=0.5),
        dict(repetition_penalty=1.2),
        dict(logit_bias={"5": 1.0}),
    ],
)
def test_requests_beyond_the_arrays_take_sglangs_path(params):
    reqs = [_Req(temperature=0.0), _Req(**params)]
    sampling = SlotSampling(8, VOCAB)
    for slot, req in enumerate(reqs):
        sampling.admit(slot, req)
    got = sampling.build(_Batch(reqs), np.array([0, 1]))
    assert got.penalizer_orchestrator is not None  # built by from_schedule_batch
    assert type(got) is SPSamplingBatchInfo  # SGLang's classmethod builds our class
    fast = sampling.build(_Batch(reqs[:1]), np.array([0]))
    assert fast.penalizer_orchestrator is None
