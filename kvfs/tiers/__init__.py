"""Tiers hold encoded objects. See base.Tier for the interface every tier implements."""

from .base import ObjectInfo, Tier
from .directory import DirectoryTier

__all__ = ["DirectoryTier", "ObjectInfo", "Tier"]
