"""SGLang's tokenizer manager with Spexis' request checks (:mod:`.input_validation`,
:mod:`.request_checks`): what would crash a rank, take the server down, or answer a bare 500
is refused with a 400 in the HTTP server's process, before any scheduler sees it."""

from __future__ import annotations

import functools
import logging

from sglang.srt.entrypoints.engine import init_tokenizer_manager
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager

from spexis_sglang.srt.config import get_config
from spexis_sglang.srt.input_validation import (
    input_ids_error,
    sampling_params_error,
    top_logprobs_num_error,
)
from spexis_sglang.srt.request_checks import (
    RequestLimits,
    generate_fanout_error,
    hidden_states_error,
    input_embeds_error,
)

logger = logging.getLogger(__name__)


def _is_multimodal(obj) -> bool:
    # multimodal prompts carry pad values outside the vocabulary by design
    contains = getattr(obj, "contains_mm_input", None)
    return bool(contains()) if callable(contains) else False


@functools.lru_cache(maxsize=1)
def sampling_param_types() -> dict:
    """SGLang's sampling parameter names and their types."""
    import msgspec
    from sglang.srt.sampling.sampling_params import SamplingParams

    return {f.name: f.type for f in msgspec.structs.fields(SamplingParams)}


def request_limits() -> RequestLimits:
    """The limits the launcher's ``--spexis-max-*`` flags set (:class:`.config.SpexisConfig`)."""
    config = get_config()
    return RequestLimits(max_n=config.max_n, max_sequences=config.max_request_sequences)


class SpexisTokenizerManager(TokenizerManager):
    """SGLang's tokenizer manager that also refuses, with a 400: out-of-vocabulary
    ``input_ids``, a ``top_logprobs_num`` beyond the vocabulary, ``n`` or a fan-out beyond the
    server's limits, malformed sampling parameters, ``return_hidden_states`` under PP, and
    ``input_embeds`` SGLang's forward would fail on."""

    async def generate_request(self, obj, request=None):
        # before SGLang expands n: n=100000 would otherwise become 100000 queued requests
        if isinstance(obj, GenerateReqInput):
            error = generate_fanout_error(
                obj.text, obj.input_ids, obj.sampling_params, request_limits()
            )
            if error is not None:
                raise ValueError(error)
        async for out in super().generate_request(obj, request):
            yield out

    def _validate_one_request(self, obj, input_ids) -> None:
        vocab_size = self.model_config.vocab_size
        error = None
        if input_ids is not None and not _is_multimodal(obj):
            error = input_ids_error(input_ids, vocab_size)
        if error is None and getattr(obj, "return_logprob", False):
            error = top_logprobs_num_error(getattr(obj, "top_logprobs_num", None), vocab_size)
        if error is None and isinstance(obj, GenerateReqInput):
            error = sampling_params_error(obj.sampling_params, sampling_param_types())
            if error is None:
                error = hidden_states_error(
                    bool(obj.return_hidden_states), self.server_args.pp_size
                )
            if error is None:
                config = self.model_config
                error = input_embeds_error(
                    obj.input_embeds,
                    config.hidden_size,
                    str(config.dtype).replace("torch.", ""),
                    self.context_len,
                )
        if error is not None:
            raise ValueError(error)
        super()._validate_one_request(obj, input_ids)


def init_spexis_tokenizer_manager(server_args, port_args, TokenizerManagerClass=None):
    """SGLang's ``init_tokenizer_manager`` with :class:`SpexisTokenizerManager`."""
    return init_tokenizer_manager(
        server_args, port_args, TokenizerManagerClass or SpexisTokenizerManager
    )
