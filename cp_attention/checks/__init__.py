"""Checks: what every rank was called with, agreed across the group before any communication, and
what the group already agreed on. Every agreement lives here: the rows ranks compare and their one
all-gather (``codec``), the P2P fold (``doubling``), the verdict cache (``agreement``), the adapters'
verdicts (``verdicts``) and ``Layout.gather``'s shard check (``gather``, installed into the layouts on
import)."""

from .agreement import (
                        VERDICTS,
                        AgreedScope,
                        Verdicts,
                        agreed_forward,
                        cache_enabled,
                        digests_agree,
                        group_token,
                        in_agreed_forward,
)
from .codec import Codec, Field, agree_rows, raise_differing, raise_first
from .doubling import agree_by_doubling
from .gather import gather_shards
from .validation import CallSpec, check_plan_table, check_table, plan_codes, tensor_codes, validate_call

__all__ = ["VERDICTS", "AgreedScope", "Verdicts", "agreed_forward", "cache_enabled", "digests_agree", "group_token",
           "in_agreed_forward", "Codec", "Field", "agree_rows", "raise_differing", "raise_first", "agree_by_doubling",
           "gather_shards", "CallSpec", "check_plan_table", "check_table", "plan_codes", "tensor_codes",
           "validate_call"]
