"""The arena's cache policies: pure logic driven by events (see base.py), and the one to use.

``base.py`` is the interface every policy implements, ``lfu.py`` the daemon's policy, ``lru.py``
its baseline; ``quotas.py`` (per-layer quotas) and ``pins.py`` (the pin book) apply to any of
them. ``POLICIES`` maps a name to its class.
"""

from expertd.serving.policy.base import STATE_FORMAT, STATE_VERSION, CachePolicy
from expertd.serving.policy.keys import KeySpace
from expertd.serving.policy.lfu import FREQUENCY_FLOOR, LfuPolicy
from expertd.serving.policy.lru import LruPolicy
from expertd.serving.policy.pins import PinBook
from expertd.serving.policy.quotas import LayerQuotas

POLICIES: dict[str, type[CachePolicy]] = {policy.name: policy for policy in (LfuPolicy, LruPolicy)}
DEFAULT_POLICY = "lfu"


def make_policy(name: str, n_rows: int, n_layers: int, n_experts: int, **options) -> CachePolicy:
    """A new policy of the class ``POLICIES[name]``; ``options`` go to its constructor.

    Raises:
        ValueError: for an unknown name, or options its constructor refuses.
    """
    policy = POLICIES.get(name)
    if policy is None:
        raise ValueError(f"unknown cache policy {name!r}; one of {', '.join(POLICIES)}")
    return policy(n_rows, n_layers, n_experts, **options)


__all__ = ["CachePolicy", "DEFAULT_POLICY", "FREQUENCY_FLOOR", "KeySpace", "LayerQuotas",
           "LfuPolicy", "LruPolicy", "POLICIES", "PinBook", "STATE_FORMAT", "STATE_VERSION",
           "make_policy"]
