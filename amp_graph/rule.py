"""``Rule``: how a node computes, the vocabulary every layer above shares.

It lives alone, below both the policy and the fp8 filters that read it, so that neither has
to import the other to name a rule (the policy holds an fp8 config; the fp8 filters compare
the policy's rule).
"""

from __future__ import annotations

from enum import Enum


class Rule(str, Enum):
    """How a node computes. The four categories of torch.autocast and TF's AMP pass."""

    ALLOW = "allow"  # low precision: floating inputs are cast to the policy dtype
    DENY = "deny"  # float32: floating inputs are cast to float32
    PROMOTE = "promote"  # floating inputs are cast to the widest floating input dtype
    FOLLOW = "follow"  # no casts: inputs as they come, torch's own type promotion

    def __str__(self) -> str:
        return self.value


__all__ = ["Rule"]
