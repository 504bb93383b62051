"""The sidecar's embedding wing: one text encoder, loaded once (``kalos serve --embed DIR``), that
embeds the texts of every pending request of a batch in one forward pass. Imports no other wing."""

from .model import EncodeStats, ModelError, TextEncoder

__all__ = ["EncodeStats", "ModelError", "TextEncoder"]
