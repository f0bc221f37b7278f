"""The served model's files before SGLang loads it: its ``config.json`` and the directory its
weights are in, for a local directory or a Hugging Face hub id (``org/name``) alike.

The launcher checks the architecture and the draft artifacts against these before any process
starts; for a hub id they come from the Hugging Face cache (the config fetched if the hub is
reachable: it is small, and SGLang fetches it next anyway)."""

from __future__ import annotations

import json
import os
from typing import Optional, Tuple


def model_config_path(model_path: str) -> Optional[str]:
    """The model's config.json: in its directory, or for a hub id the cache's copy; None
    where neither is to be had (SGLang then reports it)."""
    directory = os.path.expanduser(model_path)
    if os.path.isdir(directory):
        local = os.path.join(directory, "config.json")
        return local if os.path.isfile(local) else None
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        cached = try_to_load_from_cache(model_path, "config.json")
        if isinstance(cached, str):
            return cached
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            return None
        return hf_hub_download(model_path, "config.json")
    except Exception:  # not a hub id, no network, a gated repository: SGLang's to report
        return None


def read_model_config(model_path: str) -> dict:
    """The model's config.json as a dict; FileNotFoundError naming where it was looked for."""
    return read_model_config_and_dir(model_path)[0]


def read_model_config_and_dir(model_path: str) -> Tuple[dict, str]:
    """The model's config.json and the directory it is in, which holds the model's weights as
    far as they are on this machine (a hub id's cache snapshot has none until SGLang has
    downloaded them once)."""
    path = model_config_path(model_path)
    if path is None:
        raise FileNotFoundError(
            f"no config.json for the model {model_path!r} (neither a model directory nor a "
            "hub id in the Hugging Face cache or reachable)"
        )
    with open(path) as f:
        return json.load(f), os.path.dirname(path)
