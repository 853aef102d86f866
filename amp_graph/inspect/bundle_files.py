"""Reading a repro bundle without running its code.

A bundle is made to be shared ("here is the step that broke"), and ``pickle`` runs whatever
a file says. So every file of a bundle is read with ``torch.load(weights_only=True)``
(tensors, numbers, strings, ``None``, lists, tuples, dicts, dtypes and sizes: what
amp_graph writes there) and its policy from ``policy.json``, plain data
(:mod:`amp_graph.policy.policy_data`). A file holding anything else is refused with
:class:`BundleRefused` naming it, before any of it runs.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch

from amp_graph.policy import Policy
from amp_graph.policy.policy_data import policy_from_data

POLICY_FILE = "policy.json"


class BundleRefused(ValueError):
    """A bundle file holds something other than data: it would run code when loaded."""


def load_bundle_file(path: Path) -> Any:
    """``torch.load(path, weights_only=True)``; :class:`BundleRefused` naming the file where
    it holds anything that is not data."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise BundleRefused(
            f"amp_graph.replay refuses {path}: it holds more than tensors and plain data, "
            f"and unpickling it could run code ({first}). amp_graph writes only data into a "
            "bundle; this file was changed or written by something else. If you wrote it "
            "yourself and trust it, allow its types with "
            "torch.serialization.add_safe_globals([...]) before replaying."
        ) from None


def bundle_policy(path: Path, meta: dict[str, Any]) -> Policy:
    """The bundle's policy, from ``policy.json``. A policy holding code (a function of the
    user's) was stored as text only (``policy.txt``): ValueError saying to pass ``policy=``."""
    stored = path / POLICY_FILE
    if not stored.exists():
        raise ValueError(
            f"{path} holds its policy ({meta.get('policy')!r}) as text only: it held a "
            "function, which a bundle does not store. Pass the policy to replay: "
            "amp_graph.replay(path, model=..., policy=...)"
        )
    try:
        return policy_from_data(json.loads(stored.read_text()))
    except (ValueError, KeyError, TypeError, AttributeError, ImportError) as error:
        raise BundleRefused(f"amp_graph.replay refuses {stored}: {error}") from None


__all__ = ["POLICY_FILE", "BundleRefused", "bundle_policy", "load_bundle_file"]
