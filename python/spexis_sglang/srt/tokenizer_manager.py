"""SGLang's tokenizer manager with Spexis' request checks (see :mod:`.input_validation`)."""

from __future__ import annotations

import logging

from sglang.srt.entrypoints.engine import init_tokenizer_manager
from sglang.srt.managers.tokenizer_manager import TokenizerManager

from spexis_sglang.srt.input_validation import input_ids_error, top_logprobs_num_error

logger = logging.getLogger(__name__)


def _is_multimodal(obj) -> bool:
    # multimodal prompts carry pad values outside the vocabulary by design
    contains = getattr(obj, "contains_mm_input", None)
    return bool(contains()) if callable(contains) else False


class SpexisTokenizerManager(TokenizerManager):
    """SGLang's tokenizer manager that also refuses out-of-vocabulary ``input_ids`` and a
    ``top_logprobs_num`` beyond the vocabulary."""

    def _validate_one_request(self, obj, input_ids) -> None:
        vocab_size = self.model_config.vocab_size
        error = None
        if input_ids is not None and not _is_multimodal(obj):
            error = input_ids_error(input_ids, vocab_size)
        if error is None and getattr(obj, "return_logprob", False):
            error = top_logprobs_num_error(getattr(obj, "top_logprobs_num", None), vocab_size)
        if error is not None:
            raise ValueError(error)
        super()._validate_one_request(obj, input_ids)


def init_spexis_tokenizer_manager(server_args, port_args, TokenizerManagerClass=None):
    """SGLang's ``init_tokenizer_manager`` with :class:`SpexisTokenizerManager`."""
    return init_tokenizer_manager(
        server_args, port_args, TokenizerManagerClass or SpexisTokenizerManager
    )
