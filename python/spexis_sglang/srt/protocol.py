"""What travels between the SP ranks and to the client: wire keys, stage 0's plan, labels.

One name per thing: the proxy keys stage 0's model adds to its ``PPProxyTensors``, the plan
stage 0 relays with the requests, and the benchmark-only forced-acceptance names live here and
nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

#: stage 0's draft per row (int64 ``[rows]``) and its confidence (float32 ``[rows]``): they go
#: down the pipe with the hidden states and come back from the last stage with the true tokens
PROXY_DRAFT_IDS = "spexis_draft_ids"
PROXY_DRAFT_CONF = "spexis_draft_conf"
#: stage 0's remaining-length bucket per row (with --spexis-length-predictor); read by stage 0's
#: scheduler only, never sent down the pipe
PROXY_LENGTH_BUCKET = "spexis_length_bucket"
#: every proxy key of ours starts with this (what the later stages keep from a received proxy)
PROXY_PREFIX = "spexis_"

#: the input token of a speculative row on ranks that never see drafts (only stage 0 embeds)
PLACEHOLDER_TOKEN = 0

#: meta_info key carried by every token produced in the benchmark-only forced-acceptance mode
FORCED_LABEL = "spexis_benchmark_forced_acceptance"
#: sampling_params.custom_params key: a request's own forced acceptance (benchmark mode only),
#: so one server sweeps several values of theta without a restart
FORCE_ACCEPT_PARAM = "spexis_force_accept"


@dataclass
class SpexisPlan:
    """Stage 0's decisions for one iteration, relayed to the later stages with the requests."""

    iteration: int
    #: selective speculation: request slots (``req_pool_idx``, mirrored on every rank) whose
    #: pending draft stage 0 dropped this iteration
    dropped: List[int] = field(default_factory=list)
    #: look-ahead admission: admit at most this many waiting requests now (None = no limit)
    admit_cap: Optional[int] = None

    def is_empty(self) -> bool:
        """Nothing decided: the later stages act on it exactly as on no plan at all."""
        return not self.dropped and self.admit_cap is None


def relay_payload(recv_reqs: Optional[list], plan: SpexisPlan) -> list:
    """What a stage relays to the next one: its received requests, then its plan unless empty.

    Leaving an empty plan out makes a steady decode iteration's relay ``[]``, which SGLang's
    ``point_to_point_pyobj`` sends as one size message (no pickle, no second message)."""
    relay = list(recv_reqs or [])
    if not plan.is_empty():
        relay.append(plan)
    return relay
