"""Tiers hold encoded objects. See base.Tier for the interface every tier implements."""

from .base import ObjectInfo, Stray, Tier
from .directory import DirectoryTier
from .s3 import S3Location, S3Tier, S3Unavailable

__all__ = ["DirectoryTier", "ObjectInfo", "S3Location", "S3Tier", "S3Unavailable", "Stray", "Tier"]
