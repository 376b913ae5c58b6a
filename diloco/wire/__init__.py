"""Framing: tensors to chunks and back (one validator for every chunk), small chunks bundled
into one message, and the model fingerprint both ends compare. Below the transport, above
the value codecs."""

from diloco.wire.bundles import BUNDLE_CODEC, bundle_chunks, is_bundle
from diloco.wire.chunks import (
    MAX_CHUNK_BYTES,
    ChunkAssembler,
    SliceAssembler,
    all_finite,
    check_part,
    chunks_overlapping,
    encode_chunks,
    inner_payload_bytes,
    unbundled,
)
from diloco.wire.fingerprint import fingerprint, mismatches

__all__ = [
    "BUNDLE_CODEC", "MAX_CHUNK_BYTES", "ChunkAssembler", "SliceAssembler", "all_finite", "bundle_chunks", "check_part", "chunks_overlapping", "encode_chunks",
    "fingerprint", "inner_payload_bytes", "is_bundle", "mismatches", "unbundled",
]  # fmt: skip
