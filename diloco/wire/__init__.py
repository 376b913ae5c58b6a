"""Framing: tensors to chunks and back (one validator for every chunk), and the model
fingerprint both ends compare. Below the transport, above the value codecs."""

from diloco.wire.chunks import MAX_CHUNK_BYTES, ChunkAssembler, SliceAssembler, check_part, chunks_overlapping, encode_chunks
from diloco.wire.fingerprint import fingerprint, mismatches

__all__ = ["MAX_CHUNK_BYTES", "ChunkAssembler", "SliceAssembler", "check_part", "chunks_overlapping", "encode_chunks", "fingerprint", "mismatches"]
