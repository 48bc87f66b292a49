"""Hugging Face hub ids checked once, before anything loads: one request without retries, one line when it fails.

A model or data set loaded from the hub by transformers or datasets retries every file it asks for (5 times with
back-off): with no network, a misspelt id failed only after a minute of retries. `check_hub_id` asks the hub once
whether the repository is there, with a short timeout, and says in one line what to do when it is not: a local
folder, `HF_HUB_OFFLINE=1` with a copy in the local cache, or the network. With `HF_HUB_OFFLINE` set it asks nothing
and looks in the local cache only.
"""

from __future__ import annotations

import os
import pathlib

HUB_TIMEOUT_S = 4.0  # one request: an unreachable hub is said in a few seconds, not after a minute of retries


def check_hub_id(repo_id: str, repo_type: str, key: str) -> None:
    """Raise ValueError with one line naming `key` (e.g. "model.name") unless the hub has `repo_id` or, offline, the
    local cache does.

    Args:
        repo_id: "org/name".
        repo_type: "model" or "dataset".
        key: the recipe key that named it, quoted in the error.
    """
    from huggingface_hub import HfApi, constants, errors

    what = "model" if repo_type == "model" else "data set"
    if constants.HF_HUB_OFFLINE:
        if not is_cached(repo_id, repo_type):
            raise ValueError(
                f"{key}: {what} {repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: unset "
                "HF_HUB_OFFLINE to download it, or give a local folder"
            )
        return
    api = HfApi()
    info = api.model_info if repo_type == "model" else api.dataset_info
    try:
        info(repo_id, timeout=HUB_TIMEOUT_S)
    except errors.GatedRepoError:
        raise ValueError(
            f"{key}: {what} {repo_id!r} is gated on the hub: accept its terms on its page, then log in with "
            "`hf auth login` (or set HF_TOKEN)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise ValueError(
            f"{key}: {what} {repo_id!r} is not on the Hugging Face hub (or is private: log in with `hf auth login`); "
            "check the spelling, or give a local folder"
        ) from None
    except errors.HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        raise ValueError(
            f"{key}: the hub answered {status or 'an error'} for {what} {repo_id!r}: {_first_line(err)}; try again "
            "later, or give a local folder"
        ) from None
    except Exception as err:  # no network, DNS, a proxy, a timeout: the transport's own error types
        cached = is_cached(repo_id, repo_type)
        fix = (
            "a copy is in the local cache: set HF_HUB_OFFLINE=1 to use it"
            if cached
            else "give a local folder, check the network, or set HF_HUB_OFFLINE=1 once a copy is in the local cache"
        )
        raise ValueError(
            f"{key}: the Hugging Face hub could not be reached for {what} {repo_id!r} ({type(err).__name__}: "
            f"{_first_line(err)}); {fix}"
        ) from None


def is_cached(repo_id: str, repo_type: str) -> bool:
    """Whether the local cache holds `repo_id`: a model's config.json in the hub cache; a data set's folder in the hub
    cache or in the datasets library's own cache."""
    from huggingface_hub import constants, try_to_load_from_cache

    if repo_type == "model":
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    folder = pathlib.Path(constants.HF_HUB_CACHE) / f"datasets--{repo_id.replace('/', '--')}"
    if folder.is_dir():
        return True
    datasets_cache = os.environ.get("HF_DATASETS_CACHE") or pathlib.Path(constants.HF_HOME) / "datasets"
    return (pathlib.Path(datasets_cache) / repo_id.replace("/", "___")).is_dir()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
