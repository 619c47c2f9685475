"""Checks: what every rank was called with, agreed across the group before any communication, and
what the group already agreed on."""

from .agreement import (VERDICTS, AgreedScope, Verdicts, agreed_forward, cache_enabled, digests_agree,
                        group_token, in_agreed_forward)
from .validation import CallSpec, check_plan_table, check_table, plan_codes, tensor_codes, validate_call

__all__ = ["VERDICTS", "AgreedScope", "Verdicts", "agreed_forward", "cache_enabled", "digests_agree", "group_token",
           "in_agreed_forward", "CallSpec", "check_plan_table", "check_table", "plan_codes", "tensor_codes", "validate_call"]
