"""Tiers hold encoded objects. See base.Tier for the interface every tier implements."""

from .base import ObjectInfo, Stray, Tier
from .directory import DirectoryTier
from .member import MemberDown
from .s3 import S3Location, S3Tier, S3Unavailable
from .spread import SpreadTier

__all__ = ["DirectoryTier", "MemberDown", "ObjectInfo", "S3Location", "S3Tier", "S3Unavailable", "SpreadTier",
           "Stray", "Tier"]
