"""Audits that run before training: data (``check_batch``), model (``audit_model``) and
environment (``doctor``).

Example:
    >>> from nanguard.audit import audit_model, check_batch
    >>> check_batch({"input_ids": ids}, model=model) + audit_model(model)
    []
"""

from __future__ import annotations

from nanguard.audit.data import check_batch
from nanguard.audit.env import DoctorItem
from nanguard.audit.env import collect as doctor_items
from nanguard.audit.env import run as doctor
from nanguard.audit.model import audit_model

__all__ = ["DoctorItem", "audit_model", "check_batch", "doctor", "doctor_items"]
