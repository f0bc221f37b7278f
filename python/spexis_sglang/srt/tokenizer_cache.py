"""A server's processes unpickle their tokenizer instead of loading it (``SPEXIS_TOKENIZER_CACHE``).

A server loads its tokenizer in every process that needs one: the tokenizer manager, the
detokenizer, and each rank's scheduler and TP worker (six loads for PP=2). For the default
model one load is ~1.3 s of CPU (transformers v5 reads its ``TokenizersBackend`` tokenizer
three times before SGLang settles on it); unpickling the result takes ~0.15 s. The test suite
starts about forty servers of a few tokenizers on two cores, so it sets
``SPEXIS_TOKENIZER_CACHE=DIR``: the first load with given arguments and files goes through
SGLang's ``get_tokenizer`` and is pickled into DIR, later ones read that pickle. The key covers
the call's arguments, every non-weight file of the tokenizer's directory (name, size, mtime)
and the versions of SGLang, transformers and tokenizers, so an edited file loads afresh.
Off unless the variable is set; a tokenizer that cannot be pickled is simply loaded each time.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import os
import pickle
import tempfile
from typing import Callable, Optional

logger = logging.getLogger(__name__)

# the modules that bind SGLang's get_tokenizer by name (each rebinding is replaced)
TOKENIZER_USERS = (
    "sglang.srt.utils.hf_transformers.tokenizer",
    "sglang.srt.utils.hf_transformers",
    "sglang.srt.utils.hf_transformers_utils",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tp_worker",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager",
)
# files of a model directory that say nothing about its tokenizer
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")


def cache_key(tokenizer_name: str, args: tuple, kwargs: dict) -> Optional[str]:
    """The pickle's name for this call, or None when the tokenizer is not a local directory."""
    if not os.path.isdir(tokenizer_name):
        return None
    import sglang
    import tokenizers
    import transformers

    files = []
    for name in sorted(os.listdir(tokenizer_name)):
        path = os.path.join(tokenizer_name, name)
        if name.endswith(WEIGHT_SUFFIXES) or not os.path.isfile(path):
            continue
        st = os.stat(path)
        files.append([name, st.st_size, st.st_mtime_ns])
    versions = [sglang.__version__, transformers.__version__, tokenizers.__version__]
    call = [os.path.realpath(tokenizer_name), repr(args), repr(sorted(kwargs.items()))]
    blob = json.dumps([call, files, versions])
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def cached(get_tokenizer: Callable, cache_dir: str) -> Callable:
    """``get_tokenizer`` that reads and writes its results as pickles in ``cache_dir``."""

    @functools.wraps(get_tokenizer)
    def get_tokenizer_cached(tokenizer_name, *args, **kwargs):
        key = cache_key(tokenizer_name, args, kwargs)
        if key is None:
            return get_tokenizer(tokenizer_name, *args, **kwargs)
        path = os.path.join(cache_dir, key + ".pkl")
        try:
            with open(path, "rb") as f:
                tokenizer = pickle.load(f)
        except FileNotFoundError:
            pass
        except Exception as e:  # a torn or stale pickle: load afresh and write it again
            logger.debug("tokenizer cache: %s unreadable (%s)", path, e)
        else:
            _filter_warnings_like_sglang(tokenizer)
            return tokenizer
        tokenizer = get_tokenizer(tokenizer_name, *args, **kwargs)
        _write(path, tokenizer)
        return tokenizer

    get_tokenizer_cached.spexis_uncached = get_tokenizer
    return get_tokenizer_cached


def _filter_warnings_like_sglang(tokenizer) -> None:
    """What SGLang's load does besides returning the tokenizer: filter its module's warnings."""
    from sglang.srt.utils.hf_transformers.tokenizer import TokenizerWarningsFilter

    logging.getLogger(type(tokenizer).__module__).addFilter(TokenizerWarningsFilter())


def _write(path: str, tokenizer) -> None:
    """Write the pickle atomically (servers starting side by side may race for it)."""
    try:
        blob = pickle.dumps(tokenizer)
    except Exception as e:
        logger.debug("tokenizer cache: %s cannot be pickled (%s)", type(tokenizer).__name__, e)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
    os.replace(tmp, path)


def install_tokenizer_cache(cache_dir: Optional[str] = None) -> bool:
    """Route this process's (and its forked children's) tokenizer loads through the cache in
    ``cache_dir`` (default: ``SPEXIS_TOKENIZER_CACHE``; nothing when neither is set)."""
    from spexis_sglang.srt.config import ENV_TOKENIZER_CACHE

    cache_dir = cache_dir or os.environ.get(ENV_TOKENIZER_CACHE)
    if not cache_dir:
        return False
    from sglang.srt.utils.hf_transformers import tokenizer as tokenizer_module

    original = tokenizer_module.get_tokenizer
    if hasattr(original, "spexis_uncached"):
        return True  # installed already (in this process or the one it forked from)
    wrapper = cached(original, cache_dir)
    for name in TOKENIZER_USERS:
        module = importlib.import_module(name)
        if getattr(module, "get_tokenizer", None) is original:
            module.get_tokenizer = wrapper
    return True
